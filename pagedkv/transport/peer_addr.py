"""Who an instance is and where its control plane listens: ``PeerAddr`` and the checks on
hosts, ports and engine ids that every address from the network or the command line passes."""

from __future__ import annotations

import ipaddress
import re

import msgspec

MAX_ENGINE_ID_LEN = 256
#: Host names: dot-separated labels of letters, digits, inner hyphens (RFC 1123) and
#: underscores (container service names use them).
_LABEL = r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")


def check_host(host: str) -> None:
    """ValueError unless ``host`` is an IP address or a host name. A ZMQ endpoint is built from
    it, and ZMQ raises on a malformed one (``"a b"``, ``"*"``, NUL): such a host must be refused
    where it enters (kv_transfer_params, an envelope), never reach a socket call."""
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        raise ValueError(f"host must be an IP address or a host name, got {host!r:.80}")
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        return
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(host):
        raise ValueError(f"host must be an IP address or a host name, got {host!r:.80}")


def check_engine_id(engine_id: str) -> None:
    if not isinstance(engine_id, str) or not 0 < len(engine_id) <= MAX_ENGINE_ID_LEN:
        raise ValueError(f"engine id must be a string of 1 to {MAX_ENGINE_ID_LEN} characters")


def check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r:.80}")


def parse_host_ports(text: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]`` as (host, port) pairs: each host passes ``check_host``, each
    port ``check_port``, none is listed twice; a ValueError names the bad entry."""
    addresses: list[tuple[str, int]] = []
    for entry in (part.strip() for part in text.split(",")):
        host, sep, port = entry.rpartition(":")
        try:
            if not sep or not (port.isascii() and port.isdigit()):
                raise ValueError("not HOST:PORT")
            check_host(host)
            check_port(int(port))
        except ValueError as e:
            raise ValueError(f"{entry!r:.80}: {e}") from None
        if (host, int(port)) in addresses:
            raise ValueError(f"{entry!r:.80} is listed twice")
        addresses.append((host, int(port)))
    return addresses


def is_loopback(host: str) -> bool:
    """``host`` only reaches this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def warn_if_open(logger, what: str, host: str, secret: bytes | None) -> None:
    """Without a shared secret, anyone who reaches ``host`` is trusted: say so when that is
    more than this machine."""
    if secret is None and not is_loopback(host):
        logger.warning(
            "%s listens on %s without a shared secret: anyone who can reach it is trusted "
            "(set $PAGEDKV_KV_SECRET on every instance and the proxy)",
            what,
            host,
        )


class PeerAddr(msgspec.Struct, frozen=True, array_like=True):
    """Where an instance's control plane listens, and who it is. Checked on construction and
    on decoding (msgspec runs ``__post_init__``): a bad address is a ValueError, or a
    ``malformed`` envelope."""

    engine_id: str
    host: str
    port: int

    def __post_init__(self) -> None:
        check_engine_id(self.engine_id)
        check_host(self.host)
        check_port(self.port)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

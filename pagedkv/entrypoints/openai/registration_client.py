"""RegistrationClient: an instance's heartbeats to one ``pagedkv proxy``'s registry; and where
to send them (``proxy_addresses``).

An instance registers with every proxy it is given (``--registry HOST:PORT[,HOST:PORT...]``, or
the P2P connector's ``kv_connector_extra_config.proxies``), through one client per proxy: its
own thread, ZMQ context and DEALER, and sends that never block (a heartbeat a proxy cannot
take now is dropped; the next one is a whole registration). So a proxy that is down, slow or
unreachable never delays the heartbeats to another, and several proxies can serve the same
instances: each learns an instance from any one heartbeat (a restarted proxy within one
``proxy_heartbeat_s``), and nothing one proxy does depends on another (a P/D ``transfer_id``
is a random uuid4; D finds P in the request's ``kv_transfer_params``, not in a registry).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import zmq

from pagedkv.entrypoints.serving.registration import (
    MAX_REGISTRY_MESSAGE_BYTES,
    Deregister,
    Refused,
    Register,
    Registered,
    registry_codec,
)
from pagedkv.transport.codec import ProtocolError
from pagedkv.transport.peer_addr import PeerAddr, check_host, check_port, parse_host_ports
from pagedkv.transport.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)


def proxy_addresses(
    registry: list[tuple[str, int]] | None, extra: Mapping[str, Any]
) -> list[tuple[str, int]]:
    """The proxies to register with: ``--registry`` (parsed), else the P2P connector's
    ``kv_connector_extra_config``: ``proxies`` (a list of ``"HOST:PORT"``, or one string of
    them separated by commas) or ``proxy_ip``/``proxy_port`` (one proxy, vLLM's
    P2pNcclConnector keys); none of these: []. A bad value is a ValueError naming the key."""
    if registry is not None:
        return registry
    proxies = extra.get("proxies")
    has_pair = "proxy_ip" in extra or "proxy_port" in extra
    if proxies is not None and has_pair:
        raise ValueError("kv_connector_extra_config: give proxies or proxy_ip/proxy_port, not both")
    if proxies is not None:
        if isinstance(proxies, list) and proxies and all(isinstance(p, str) for p in proxies):
            proxies = ",".join(proxies)
        if not isinstance(proxies, str):
            raise ValueError(
                'kv_connector_extra_config.proxies must be a list of "HOST:PORT" strings, '
                f"got {proxies!r:.80}"
            )
        try:
            return parse_host_ports(proxies)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config.proxies: {e}") from None
    if not has_pair:
        return []
    if "proxy_ip" not in extra or "proxy_port" not in extra:
        raise ValueError("kv_connector_extra_config.proxy_ip and proxy_port go together")
    host, port = extra["proxy_ip"], extra["proxy_port"]
    try:
        check_host(host)
        if isinstance(port, str) and port.isascii() and port.isdigit():
            port = int(port)  # vLLM's examples give the port as a string
        check_port(port)
    except ValueError as e:
        raise ValueError(f"kv_connector_extra_config.proxy_ip/proxy_port: {e}") from None
    return [(host, port)]


class RegistrationClient:
    """The instance's side, for one proxy: a thread that sends ``Register`` heartbeats to it
    and reads its answers (logging a refusal, or an authentication mismatch, at WARNING)."""

    def __init__(
        self,
        proxy_host: str,
        proxy_port: int,
        me: PeerAddr,
        describe: Callable[[], Register],
        secret: bytes | None,
        interval_s: float = 2.0,
    ) -> None:
        self._endpoint = f"tcp://{proxy_host}:{proxy_port}"
        self._me = me
        self._describe = describe
        self._codec = registry_codec(secret)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._log = RateLimitedLog(logger)
        #: The proxy's last answer: a Registered, a Refused, or a ProtocolError (None: none).
        self.last_answer: msgspec.Struct | ProtocolError | None = None
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"proxy-registration-{proxy_host}:{proxy_port}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        ctx = zmq.Context()
        socket = ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 500)
        socket.setsockopt(zmq.SNDHWM, 10)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REGISTRY_MESSAGE_BYTES * 4)
        socket.connect(self._endpoint)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self._interval_s
                    self._beat(socket)
                wait_ms = min(100, max(1, int((next_beat - now) * 1000)))
                if poller.poll(wait_ms):
                    self._on_answer(socket.recv_multipart(zmq.NOBLOCK))
            socket.send_multipart(self._codec.encode(Deregister(), self._me), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            socket.close()
            ctx.term()

    def _beat(self, socket: zmq.Socket) -> None:
        try:
            socket.send_multipart(self._codec.encode(self._describe(), self._me), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the proxy is not there (yet): the next heartbeat tries again
        except Exception:
            logger.exception("registration heartbeat failed (continuing)")

    def _on_answer(self, frames: list[bytes]) -> None:
        where = self._endpoint
        now = time.monotonic()
        silent_s, self._last_heard = now - self._last_heard, now
        try:
            _, answer = self._codec.decode(frames)
        except ProtocolError as e:
            self.last_answer = e
            self._log.warning(e.reason, "the proxy at %s: its answer was refused: %s", where, e)
            return
        previous, self.last_answer = self.last_answer, answer
        if isinstance(answer, Refused):
            self._log.warning(
                answer.reason, "the proxy at %s refused this instance: %s", where, answer.reason
            )
        elif isinstance(answer, Registered) and (
            answer != previous or silent_s > 3 * self._interval_s  # the proxy is back
        ):
            if answer.note:
                logger.warning("registered with the proxy at %s, but: %s", where, answer.note)
            else:
                logger.info("registered with the proxy at %s", where)

    def stop(self) -> None:
        """Say goodbye to the proxy (``Deregister``) and stop, without waiting for it."""
        self._stop.set()

    def close(self) -> None:
        self.stop()
        self._thread.join(timeout=5)


def close_all(clients: list[RegistrationClient]) -> None:
    """Stop every client at once (each says goodbye to its proxy), then wait for them: a proxy
    that is down costs its own client's linger, not the others'."""
    for client in clients:
        client.stop()
    for client in clients:
        client.close()

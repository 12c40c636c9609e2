"""A real bandwidth-limited link on one machine: two network namespaces joined by a veth pair,
each end shaped with ``tc`` ``tbf`` (the kernels we run on have veth and tbf, not netem).

    with NetnsLink(rate_bit=1_000_000_000) as link:
        server = subprocess.Popen(link.command("p", ["python", "-m", "pagedkv", "serve", ...]))
        with link.entered("p"):            # this thread's new sockets live in P's namespace
            httpx.get(f"http://{link.address('p')}:8000/health")
        link.sent_bytes("p")               # bytes P's end of the link has sent (tc's counter)

The addresses (``10.231.0.1/30`` on P's end, ``.2`` on D's) exist only inside the two
namespaces, so links of concurrent runs never collide; namespace names carry the owner's pid
(``pkvlink-<pid>-<n>-<side>``), and entering a link first removes those of owners that died
(a pid now held by a process started after the namespace was made is not its owner). Leaving
it ends whatever still runs inside and deletes both namespaces, which deletes the veth pair.

Needs root and iproute2 (``ip``, ``tc``): ``unsupported_reason()`` says why not (tried once a
process); ``require_link()`` skips a test with it. ``tbf_burst_bytes``: measured on veth with
a raw TCP stream, a bucket of 2 ms of the rate lets 1 Gbit/s and 10 Gbit/s carry ~0.96 of the
rate in TCP payload (the rest is Ethernet, IP and TCP headers, which tbf counts); 1 ms holds
10 Gbit/s to ~8 Gbit/s (the machine's CPU carries ~11 Gbit/s unshaped).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PREFIX = "pkvlink"
SIDES = ("p", "d")
#: Each side's address (a /30 between them); it exists only inside that side's namespace.
ADDRESSES = {"p": "10.231.0.1", "d": "10.231.0.2"}
DEVICE = "veth0"
#: How long a packet may wait in tbf's queue before it is dropped.
LATENCY_MS = 50
_NETNS_DIR = Path("/run/netns")
_NAME = re.compile(rf"^{PREFIX}-(\d+)-\d+-[pd]$")
_CLONE_NEWNET = 0x40000000
_serial = itertools.count()
#: Accepts one connection on argv[1]:argv[2], reads it to the end, prints the bytes read.
_SINK = (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], int(sys.argv[2]))); print('ready', flush=True)\n"
    "c, _ = s.accept(); n = 0\n"
    "while chunk := c.recv(1 << 20): n += len(chunk)\n"
    "print(n)\n"
)


class LinkError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message is its command line and stderr."""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise LinkError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def tbf_burst_bytes(rate_bit: int) -> int:
    """tbf's bucket for ``rate_bit``: 2 ms of the rate, at least 16 KiB (a few packets)."""
    return max(rate_bit // 8 // 500, 16 << 10)


class NetnsLink:
    """Namespaces ``p`` and ``d`` joined by a veth pair shaped to ``rate_bit`` each way."""

    def __init__(self, rate_bit: int) -> None:
        self.rate_bit = rate_bit
        serial = next(_serial)
        self._namespaces = {side: f"{PREFIX}-{os.getpid()}-{serial}-{side}" for side in SIDES}

    def namespace(self, side: str) -> str:
        return self._namespaces[side]

    def address(self, side: str) -> str:
        return ADDRESSES[side]

    def command(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``side``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self._namespaces[side], *argv]

    def __enter__(self) -> NetnsLink:
        remove_leftovers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        p, d = self._namespaces["p"], self._namespaces["d"]
        for ns in (p, d):
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", DEVICE, "netns", p, "type", "veth", "peer", DEVICE, "netns", d)
        for side, ns in self._namespaces.items():
            _run("ip", "-n", ns, "addr", "add", f"{ADDRESSES[side]}/30", "dev", DEVICE)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", DEVICE, "up")
        self.set_rate(self.rate_bit)

    def set_rate(self, rate_bit: int) -> None:
        """Shape both ends to ``rate_bit`` (a fresh qdisc: its counters start at 0)."""
        self.rate_bit = rate_bit
        shape = ["rate", f"{rate_bit}bit", "burst", str(tbf_burst_bytes(rate_bit))]
        for ns in self._namespaces.values():
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", DEVICE, "root"], check=False,
                           capture_output=True)  # fmt: skip
            _run("tc", "-n", ns, "qdisc", "add", "dev", DEVICE, "root", "tbf", *shape,
                 "latency", f"{LATENCY_MS}ms")  # fmt: skip

    def sent_bytes(self, side: str) -> int:
        """Bytes (with their Ethernet, IP and TCP headers) ``side``'s end has sent through its
        tbf qdisc since the rate was last set."""
        out = _run("tc", "-n", self._namespaces[side], "-s", "qdisc", "show", "dev", DEVICE)
        found = re.search(r"Sent (\d+) bytes", out)
        if found is None:
            raise LinkError(f"no byte counter in tc's answer: {out!r}")
        return int(found.group(1))

    @contextlib.contextmanager
    def entered(self, side: str) -> Iterator[None]:
        """The calling thread in ``side``'s namespace for the block: sockets it opens there
        stay there (a pooled connection keeps working after the block; a new one made
        outside cannot reach the link's addresses)."""
        with (
            open("/proc/thread-self/ns/net") as home,
            open(_NETNS_DIR / self._namespaces[side]) as ns,
        ):
            _setns(ns.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def close(self) -> None:
        for ns in self._namespaces.values():
            _remove_namespace(ns)

    def send_tcp(self, num_bytes: int, port: int = 5001) -> float:
        """Seconds a raw TCP stream of ``num_bytes`` takes from P's side to a reader on D's
        (from the first byte sent to the reader's count of all of them)."""
        sink = subprocess.Popen(
            self.command("d", [sys.executable, "-c", _SINK, ADDRESSES["d"], str(port)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if sink.stdout.readline() != "ready\n":
                raise LinkError(f"the TCP reader in {self._namespaces['d']} did not start")
            with self.entered("p"):
                connection = socket.create_connection((ADDRESSES["d"], port), timeout=60)
            payload = memoryview(bytearray(b"\x5a" * min(num_bytes, 4 << 20)))
            start = time.perf_counter()
            with connection:
                for offset in range(0, num_bytes, len(payload)):
                    connection.sendall(payload[: num_bytes - offset])
            received = int(sink.communicate(timeout=120)[0])
            elapsed = time.perf_counter() - start
        finally:
            sink.kill()
            sink.wait()
        if received != num_bytes:
            raise LinkError(f"sent {num_bytes} bytes over the link, {received} arrived")
        return elapsed


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise LinkError(f"setns: {os.strerror(ctypes.get_errno())}")


def _remove_namespace(ns: str) -> None:
    """End the processes inside ``ns`` (started there by its owner), then delete it."""
    if not (_NETNS_DIR / ns).exists():
        return
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in map(int, pids.split()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, StopIteration):
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


def remove_leftovers() -> list[str]:
    """Delete the namespaces this module made for owners that are gone; their names."""
    removed = []
    for path in _NETNS_DIR.glob(f"{PREFIX}-*") if _NETNS_DIR.is_dir() else ():
        found = _NAME.match(path.name)
        if found is None:
            continue
        started = _started_at(int(found.group(1)))
        with contextlib.suppress(FileNotFoundError):
            made = path.stat().st_mtime
            if started is None or started > made + 1.0:  # btime has a 1 s resolution
                _remove_namespace(path.name)
                removed.append(path.name)
    return removed


@functools.cache
def unsupported_reason() -> str | None:
    """Why this process cannot make a link (None: it can): tried once, then remembered."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 is not installed ({', '.join(missing)} not found)"
    try:
        with NetnsLink(rate_bit=1_000_000_000) as link:
            link.sent_bytes("p")
    except (LinkError, OSError, subprocess.TimeoutExpired) as e:
        return f"this kernel or container cannot make a shaped veth link: {e}"
    return None


def require_link() -> None:
    """In a test: skip with the reason when there can be no link, or fail where
    ``PAGEDKV_REQUIRE_NETNS=1`` (CI) says there must be one."""
    import pytest

    reason = unsupported_reason()
    if reason is None:
        return
    if os.environ.get("PAGEDKV_REQUIRE_NETNS") == "1":
        pytest.fail(f"PAGEDKV_REQUIRE_NETNS=1, but no shaped link: {reason}")
    pytest.skip(reason)

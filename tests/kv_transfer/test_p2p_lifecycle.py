"""Peers coming, going, hanging and disagreeing, between engines in separate processes: P's
footprint over D lifecycles, a cancel to a hung P, a secret on one side only, and a request
D had to queue for longer than P's lease."""

from __future__ import annotations

import os
import signal
import time
import uuid

from tests.kv_transfer.engine_host import p2p_config
from tests.kv_transfer.test_p2p_engines import MAX_TOKENS, disaggregate
from tests.tiny_models import random_prompt


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    from tests.kv_transfer.test_pd_proxy import _listening_sockets

    return _listening_sockets(pid)


def _accepted_on(pid: int, port: int) -> int:
    """How many of ``pid``'s descriptors are connections accepted on ``port`` (not listening)."""
    inodes = {
        target[8:-1]
        for fd in os.listdir(f"/proc/{pid}/fd")
        if (target := _readlink(f"/proc/{pid}/fd/{fd}")).startswith("socket:[")
    }
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] != "0A" and fields[9] in inodes:
                    count += 1
    return count


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def footprint(pid: int, http_port: int | None = None) -> tuple[int, int, int]:
    """(listening sockets, threads, file descriptors) of process ``pid``. Connections accepted
    on ``http_port`` are left out of the descriptors: how many a client's pool keeps open is
    the client's business (the proxy's httpx pool closes an idle one only when it next
    sends, and a server keeps one for 75 s)."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    if http_port is not None:
        fds -= _accepted_on(pid, http_port)
    return (len(listening_sockets(pid)), len(os.listdir(f"/proc/{pid}/task")), fds)


def thread_names(pid: int) -> list[str]:
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(names)


def steady_footprint(
    pid: int, steady_s: float = 3.0, timeout_s: float = 30.0, http_port: int | None = None
):
    """The footprint once it has not changed for ``steady_s`` (an idle worker thread goes
    after a while)."""
    deadline = time.monotonic() + timeout_s
    last, since = footprint(pid, http_port), time.monotonic()
    while time.monotonic() - since < steady_s:
        assert time.monotonic() < deadline, f"footprint never steady: {last}"
        time.sleep(0.2)
        now = footprint(pid, http_port)
        if now != last:
            last, since = now, time.monotonic()
    return last


def wait_for_footprint(
    pid: int, rest: tuple[int, int, int], timeout_s: float, http_port: int | None = None
) -> None:
    """Until no count of the footprint is above ``rest``."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = footprint(pid, http_port)
        if all(n <= r for n, r in zip(now, rest)):
            return
        assert time.monotonic() < deadline, (
            f"P's footprint {now}, at rest {rest}; threads {thread_names(pid)}"
        )
        time.sleep(0.2)


def test_p_comes_back_to_its_footprint_after_every_d_lifecycle(start_engine, reference_outputs):
    """Three D instances in turn (a new engine id each) load from one P, then go: killed
    (SIGKILL: P finds it silent after peer_timeout_s) or shut down (it says goodbye). After
    each, P's listening sockets, threads and file descriptors are back where they were
    before the first D (test_pd_churn.py does four over HTTP). (Before, P kept every
    departed D's pair group, its gloo listener, threads and sockets: 5 -> 8 sockets,
    25 -> 34 threads, 40 -> 54 fds over four D.)"""
    fast = {"peer_timeout_s": 2.0, "lease_s": 2.0}
    p = start_engine("P", kv_transfer_config=p2p_config("kv_producer", "P-0", **fast))
    p.add("warm-up", random_prompt(40, seed=1999), max_tokens=2)  # torch's thread pools
    p.wait(["warm-up"])
    p.wait_settled()
    rest = steady_footprint(p.process.pid)
    for i in range(3):
        d = start_engine(f"D-{i}", kv_transfer_config=p2p_config("kv_consumer", f"D-{i}", **fast))
        prompt = random_prompt(40, seed=2000 + i)
        (out,) = disaggregate(p, d, [prompt])
        assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0]
        p.wait_settled()
        if i % 2:
            d.kill()
        else:
            d.close()
        # peer_timeout_s to find it gone, lease_s for its DEALER to flush, a tick or two more
        wait_for_footprint(p.process.pid, rest, timeout_s=15)
    assert p.stats()["connector"]["pair_groups"] == 0


def test_a_cancel_reaches_a_p_that_was_only_hung(start_engine) -> None:
    """P holds a request's KV; P is SIGSTOPped; D asks for it, hears nothing, gives up after
    peer_timeout_s (2 s) and fails its request with an error naming P. The CANCEL it sent
    must still reach P: P frees the blocks within 2 s of being SIGCONTed, not when its 20 s
    lease ends (before, D closed its connection to P at once, dropping the CANCEL)."""
    p = start_engine("P", kv_transfer_config=p2p_config("kv_producer", "P-0", lease_s=20.0))
    d = start_engine("D", kv_transfer_config=p2p_config("kv_consumer", "D-0", peer_timeout_s=2.0))
    p.wait_ready()
    d.wait_ready()
    prompt = random_prompt(40, seed=2100)
    tid = uuid.uuid4().hex
    p.add("r", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    p.wait(["r"])
    assert p.stats()["kv_cache_usage"] > 0  # held for D
    os.kill(p.process.pid, signal.SIGSTOP)
    try:
        d.add("r", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address})
        out = d.wait(["r"], timeout_s=20)["r"]
    finally:
        os.kill(p.process.pid, signal.SIGCONT)
    resumed = time.monotonic()
    p.wait_settled(timeout_s=5)
    assert time.monotonic() - resumed < 2.0
    assert "cancelled by D" in p.log()
    assert out["finish_reason"] == "error"
    assert "from P-0" in out["error"] and "peer lost" in out["error"], out["error"]


def test_a_secret_on_p_only_fails_the_load_fast_and_says_why(start_engine) -> None:
    """PAGEDKV_KV_SECRET on P only: both refuse the other's messages as an authentication
    mismatch and log it at WARNING; D's request fails within seconds (not after D's 10 s
    peer timeout as "P silent") with an error naming P and the mismatch."""
    p = start_engine(
        "P",
        kv_transfer_config=p2p_config("kv_producer", "P-0", shared_secret="only-on-p", lease_s=3.0),
    )
    d = start_engine("D", kv_transfer_config=p2p_config("kv_consumer", "D-0"))
    prompt = random_prompt(40, seed=2200)
    p.wait_ready()
    d.wait_ready()
    t0 = time.monotonic()
    (out,) = disaggregate(p, d, [prompt])
    assert time.monotonic() - t0 < 5
    assert out["finish_reason"] == "error"
    assert "from P-0" in out["error"] and "authentication mismatch" in out["error"], out
    for host in (p, d):
        assert "WARNING" in host.log() and "authentication mismatch" in host.log()
    p.wait_settled(timeout_s=10)  # P frees the KV nobody could fetch at its 3 s lease
    d.wait_settled()


def test_a_request_d_queues_longer_than_ps_lease_still_gets_its_kv(
    start_engine, reference_outputs
) -> None:
    """D runs one request at a time and is busy decoding: a disaggregated request waits for
    admission for seconds while P's lease is 0.6 s. D names it in its heartbeats (every
    0.2 s), so P keeps the KV, and the request's output is exact once D admits it. (Before,
    P's lease expired, P refused the late WANT and the request failed: the preemption storm
    test's empty outputs.)"""
    p = start_engine("P", kv_transfer_config=p2p_config("kv_producer", "P-0", lease_s=0.6))
    d = start_engine(
        "D",
        kv_transfer_config=p2p_config("kv_consumer", "D-0", heartbeat_s=0.2),
        max_num_seqs=1,
    )
    p.wait_ready()
    d.wait_ready()
    d.add("busy", random_prompt(20, seed=2300), max_tokens=230)
    prompt = random_prompt(40, seed=2301)
    tid = uuid.uuid4().hex
    d.add("r", prompt, {"do_remote_prefill": True, "transfer_id": tid, **p.kv_address},
          max_tokens=MAX_TOKENS)  # fmt: skip
    p.add("r", prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    time.sleep(3.0)  # queued on D: P's lease would have ended five times over
    d.call("abort", request_id="busy")  # (if it has not finished by itself)
    out = d.wait(["r"])["r"]
    assert out["token_ids"] == reference_outputs("llama", [prompt], MAX_TOKENS)[0], out
    assert p.wait_settled()["connector"]["num_sends_delivered"] == 1

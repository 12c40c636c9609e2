#!/usr/bin/env python
"""Prefill/decode transfer benchmark, two parts, each against its peer in the same run.

(a) bandwidth: the KV of one prompt (32 layers, 8 KV heads, head size 128, fp16 = 128 KiB per
    token, blocks of 16 tokens scattered over the cache) moved from a P process to a D process
    through the P2P connector's data path: the pair group's lanes (set up over our control
    plane; D cuts the messages at breaks in its block ids where the runs are long enough;
    a message whose blocks are consecutive goes from and into the cache itself, any other is
    packed by P's send lane with the compiled block copy while the previous message is on
    the wire, received by D's lane into a reused staging ring and scattered into the paged
    cache by the compiled copy while the next ones arrive), then the same bytes between
    the same two processes over a raw loopback TCP socket (sendall / recv_into, no packing).
    GB/s of both and their ratio.
(b) ttft: a small random Llama (the hf_peer anchor's: 19M parameters, 4 layers) behind
    ``pagedkv proxy`` in 1P1D (PUT_ASYNC) against one plain ``pagedkv serve``; ~2k-token
    prompts, each distinct (no prefix reuse), max_tokens=1 so a request's latency is its TTFT.

Medians over repeats. The machine may be shared with other work: its load is printed.

    python benchmarks/pd_transfer.py                 # both parts, 1k-16k tokens (~3 min)
    python benchmarks/pd_transfer.py --quick         # 1k and 4k tokens, fewer repeats
    python benchmarks/pd_transfer.py --part bandwidth --tokens 1024,8192 --chunk-mib 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.float16
BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE * 2  # 128 KiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_info() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return (
        f"{cpu}, {os.cpu_count()} cores (load {', '.join(f'{x:.1f}' for x in load)}), "
        f"Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {platform.system()} {platform.release()}"
    )


# ============================================================================ (a) bandwidth
def _layer_caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    caches = []
    for layer in range(NUM_LAYERS):
        cache = torch.zeros(shape, dtype=DTYPE)
        if fill:  # block b of layer l holds (b + l) % 1024: exact in fp16, checkable on D
            values = (torch.arange(num_blocks) + layer) % 1024
            cache.copy_(values.view(1, -1, 1, 1, 1).to(DTYPE).expand(shape))
        caches.append(cache)
    return caches


#: Blocks per run in the "runs" placement: a free queue handing out runs of consecutive
#: blocks, the runs themselves anywhere in the cache (a fragmented pool).
RUN_BLOCKS = 16
PLACEMENTS = ("random", "runs", "contiguous")


def block_ids(num_cache_blocks: int, n: int, placement: str, gen: torch.Generator) -> torch.Tensor:
    """``n`` block ids in [1, num_cache_blocks), a different draw on each side:
    "random"      every block anywhere (worst case: every message packed and scattered)
    "runs"        runs of RUN_BLOCKS anywhere (a message spans several runs)
    "contiguous"  one range at a random offset (a fresh pool: D receives in place)"""
    if placement == "random":
        return torch.randperm(num_cache_blocks - 1, generator=gen)[:n] + 1
    if placement == "contiguous":
        return torch.randint(0, num_cache_blocks - n, (1,), generator=gen) + torch.arange(n) + 1
    num_runs = (num_cache_blocks - 1) // RUN_BLOCKS
    starts = torch.randperm(num_runs, generator=gen)[: -(-n // RUN_BLOCKS)]
    return (starts[:, None] * RUN_BLOCKS + torch.arange(RUN_BLOCKS)).flatten()[:n] + 1


def _peer(role: str, conn, args: dict) -> None:
    """One side of the bandwidth test (a spawned process). Commands arrive as JSON."""
    from pagedkv.kv_transfer.p2p.lanes import Job, SendLane
    from pagedkv.kv_transfer.p2p.pair_group import PairGroups
    from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES, Hello, StoreSet, XferBegin
    from pagedkv.kv_transfer.p2p.receive_lane import ReceiveLane
    from pagedkv.kv_transfer.p2p.send_modes import HeldSource, SendContext
    from pagedkv.kv_transfer.p2p.send_pool import SendPool
    from pagedkv.kv_transfer.p2p.transfer import (
        LayerBlocks,
        block_bytes,
        chunk_blocks_for,
        min_run_blocks_for,
        plan_segments_at_runs,
    )
    from pagedkv.transport.codec import Codec
    from pagedkv.transport.control_plane import ControlPlane
    from pagedkv.transport.peer_addr import PeerAddr

    class Load:  # a receive target, as D's load records are; cancelled: received, not stored
        def __init__(self, cancelled: bool) -> None:
            self.lock = threading.Lock()
            self.cancelled = cancelled
            self.posted = 0

    torch.set_num_threads(args["threads"])
    me = PeerAddr(role, "127.0.0.1", args[f"{role}_port"])
    other = PeerAddr(
        "D" if role == "P" else "P", "127.0.0.1", args["D_port" if role == "P" else "P_port"]
    )
    holder: dict = {}

    def receive(begin: XferBegin) -> None:  # a handler's return value is its answer: none
        holder["lane"].submit(begin)

    plane = ControlPlane(
        Codec("bench", None, 1 << 20, MESSAGE_TYPES),
        me,
        {
            Hello: lambda peer, m: holder["groups"].on_hello(peer, m),
            StoreSet: lambda peer, m: holder["groups"].on_store_set(peer, m),
            XferBegin: lambda peer, m: receive(m),
        },
        name=role,
    )
    groups = holder["groups"] = PairGroups(me, plane.send, 30, 60)
    plane.start()
    num_blocks = args["max_blocks"] + 1
    caches = _layer_caches(num_blocks, fill=role == "P")
    ctx = SendContext(caches, [0] * NUM_LAYERS, BLOCK_SIZE, SendPool(0), 60)
    chunk_blocks = chunk_blocks_for(block_bytes(caches[0]), args["chunk_bytes"])
    min_run_blocks = min_run_blocks_for(block_bytes(caches[0]), chunk_blocks)
    tcp = socket.socket()
    if role == "D":
        tcp.bind(("127.0.0.1", args["tcp_port"]))
        tcp.listen(1)
    conn.send(json.dumps({"ready": True}))
    peer_sock = lane = None
    #: D: the transfer being received -> (target, layers, set when received), or None: drain.
    current: dict = {}
    received = threading.Event()
    while True:
        command = json.loads(conn.recv())
        op = command["op"]
        if op == "stop":
            break
        if op == "connect":  # D initiates the pair group, as on a first WANT
            if role == "D":
                group = groups.ensure(other)
                group.ready.wait(30)
                peer_sock, _ = tcp.accept()
                lane = holder["lane"] = ReceiveLane(
                    group.pg, group.peer_rank,
                    lambda tid, segments: current.get("target"),
                    lambda segments: current["drain"],
                    lambda target, n, error: received.set(),
                    lambda reason: print("D lane broken:", reason), args["in_flight_bytes"], 60,
                    "bench-recv",
                )  # fmt: skip
            else:
                deadline = time.monotonic() + 30
                while groups.get("D") is None or groups.get("D").pg is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError("pair group")
                    time.sleep(0.01)
                group = groups.get("D")
                tcp.connect(("127.0.0.1", args["tcp_port"]))
                peer_sock = tcp
                lane = SendLane(
                    group.pg, group.peer_rank, group.name, NUM_LAYERS,
                    lambda begin: plane.send(other, begin), lambda job: None,
                    lambda reason: print("P lane broken:", reason), args["in_flight_bytes"], 60,
                    "bench-send",
                )  # fmt: skip
            lane.start()
            peer_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.send(json.dumps({"ok": True}))
            continue
        # Where the request's blocks are on each side (never the null block), different on P
        # and D, known to both: see ``block_ids``.
        gen = torch.Generator().manual_seed(command["seed"])
        n = command["num_blocks"]
        src_ids, dst_ids = (block_ids(num_blocks, n, args["placement"], gen) for _ in "PD")
        # D's plan, as in a WANT (inbound.py)
        segments = [plan_segments_at_runs(dst_ids.tolist(), chunk_blocks, min_run_blocks)]
        if role == "D":  # "gloo": the same messages into staging only (no scatter)
            layers = [LayerBlocks(cache, dst_ids, segments[0]) for cache in caches]
            current["target"] = (Load(cancelled=op == "gloo"), layers)
            current["drain"] = layers
            received.clear()
        conn.send(json.dumps({"armed": True}))
        json.loads(conn.recv())  # "go"
        t0 = time.monotonic()
        if op in ("connector", "gloo") and role == "P":
            if op == "connector":
                source = HeldSource(caches, ctx, [src_ids], segments)
            else:  # the same messages from one ready run of blocks: no packing
                source = HeldSource(caches, ctx, [torch.arange(1, n + 1)], segments)
            job = Job(f"t{command['seed']}", segments, source, 0)
            lane.submit([job])
            job.ended.wait(300)
            if job.error is not None:
                raise job.error
        elif op in ("connector", "gloo"):
            received.wait(300)
        elif op == "tcp" and role == "P":
            for cache in caches:
                for kv in (0, 1):
                    data = cache[kv, :n].view(torch.uint8).numpy()
                    peer_sock.sendall(memoryview(data).cast("B"))
        else:  # tcp, D: straight into contiguous cache memory (no scatter)
            for cache in caches:
                for kv in (0, 1):
                    view = memoryview(cache[kv, :n].view(torch.uint8).numpy()).cast("B")
                    got = 0
                    while got < len(view):
                        got += peer_sock.recv_into(view[got:])
        t1 = time.monotonic()
        check = None
        if role == "D" and op == "connector":  # the blocks landed where D wanted them
            layer = NUM_LAYERS - 1
            expected = ((src_ids + layer) % 1024).to(DTYPE)
            check = bool(torch.equal(caches[layer][1, dst_ids, -1, -1, -1], expected))
        conn.send(json.dumps({"t0": t0, "t1": t1, "check": check}))
    if lane is not None:
        lane.stop("done")
        lane.join(10)  # the process group goes with its thread, before the interpreter
    if peer_sock is not None:
        peer_sock.close()
    groups.close()
    plane.close()


def run_bandwidth(
    tokens: list[int], repeats: int, chunk_bytes: int, in_flight_bytes: int, placement: str
) -> list:
    # Room for the largest prompt (in runs, and with slack to place it contiguously).
    max_blocks = -(-max(tokens) // BLOCK_SIZE // RUN_BLOCKS) * RUN_BLOCKS * 5 // 4
    args = {
        "placement": placement,
        "P_port": free_port(),
        "D_port": free_port(),
        "tcp_port": free_port(),
        "max_blocks": max_blocks,
        "chunk_bytes": chunk_bytes,
        "in_flight_bytes": in_flight_bytes,
        "threads": max(1, (os.cpu_count() or 2) // 2),
    }
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for role in ("P", "D"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_peer, args=(role, child, args), daemon=True)
        proc.start()
        pipes[role] = parent
        procs.append(proc)

    def ask(role: str, message: dict | None = None, timeout: float = 300):
        if message is not None:
            pipes[role].send(json.dumps(message))
        if not pipes[role].poll(timeout):
            raise TimeoutError(f"{role} did not answer")
        return json.loads(pipes[role].recv())

    rows = []
    try:
        for role in ("P", "D"):
            ask(role)
        for role in ("D", "P"):
            pipes[role].send(json.dumps({"op": "connect"}))
        for role in ("P", "D"):
            ask(role)
        for n_tokens in tokens:
            num_blocks = n_tokens // BLOCK_SIZE
            total_bytes = n_tokens * BYTES_PER_TOKEN
            times: dict[str, list[float]] = {"connector": [], "gloo": [], "tcp": []}
            for rep in range(repeats + 1):  # the first is a warm-up (page faults, buffers)
                for op in times:
                    command = {"op": op, "num_blocks": num_blocks, "seed": rep}
                    for role in ("D", "P"):
                        ask(role, command)
                    for role in ("D", "P"):
                        pipes[role].send(json.dumps({"go": True}))
                    d, p = ask("D"), ask("P")
                    if d["check"] is False:
                        raise AssertionError("D's blocks do not hold P's KV")
                    if rep:
                        times[op].append(d["t1"] - min(d["t0"], p["t0"]))
            gbps = {op: total_bytes / statistics.median(t) / 1e9 for op, t in times.items()}
            rows.append((n_tokens, total_bytes, gbps["connector"], gbps["tcp"]))
            print(
                f"  {n_tokens:6d} tokens {total_bytes / 2**20:7.0f} MiB   connector "
                f"{gbps['connector']:5.2f} GB/s   raw TCP {gbps['tcp']:5.2f} GB/s   "
                f"ratio {gbps['connector'] / gbps['tcp']:4.2f}   (gloo alone, no pack/scatter: "
                f"{gbps['gloo']:5.2f} GB/s)",
                flush=True,
            )
    finally:
        for role in ("P", "D"):
            with contextlib.suppress(OSError):
                pipes[role].send(json.dumps({"op": "stop"}))
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
    return rows


# ============================================================================ (b) TTFT
def build_small_llama(directory: Path) -> None:
    """The hf_peer anchor's tiny Llama (seed 1234), without a tokenizer: token-id prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(directory)


class Processes:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDKV_KV_SECRET": "bench-secret"}
        log = (self.log_dir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_health(url: str, timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy")


def run_ttft(prompt_len: int, repeats: int, send_type: str) -> tuple[float, float]:
    import httpx

    tmp = Path(tempfile.mkdtemp(prefix="pd_ttft_"))
    model = tmp / "model"
    build_small_llama(model)
    procs = Processes(tmp)
    common = ["--max-model-len", "4096", "--log-level", "warning"]
    try:
        single_port, proxy_port, registry_port = free_port(), free_port(), free_port()
        procs.start("single", "serve", str(model), "--port", str(single_port), *common)
        procs.start(
            "proxy", "proxy", "--port", str(proxy_port), "--registry-port", str(registry_port),
            "--log-level", "warning",
        )  # fmt: skip
        urls = {"single": f"http://127.0.0.1:{single_port}", "pd": f"http://127.0.0.1:{proxy_port}"}
        for role, name in (("kv_producer", "P"), ("kv_consumer", "D")):
            config = {
                "kv_connector": "P2pConnector",
                "kv_role": role,
                "kv_port": free_port(),
                "engine_id": f"bench-{name}",
                "kv_connector_extra_config": {
                    "send_type": send_type,
                    "proxy_ip": "127.0.0.1",
                    "proxy_port": registry_port,
                },
            }
            port = free_port()
            procs.start(
                name, "serve", str(model), "--port", str(port), *common,
                "--kv-transfer-config", json.dumps(config),
            )  # fmt: skip
            wait_health(f"http://127.0.0.1:{port}")
        for url in urls.values():
            wait_health(url)
        deadline = time.monotonic() + 30
        while True:
            live = httpx.get(f"{urls['pd']}/instances", timeout=5).json()
            if live["prefill"] and live["decode"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances did not register: {live}")
            time.sleep(0.2)

        gen = torch.Generator().manual_seed(0)
        results: dict[str, list[float]] = {"single": [], "pd": []}
        with httpx.Client(timeout=300) as client:
            for rep in range(repeats + 1):  # the first round warms both paths up
                for target in ("single", "pd"):
                    prompt = torch.randint(10, 32000, (prompt_len,), generator=gen).tolist()
                    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
                    t0 = time.perf_counter()
                    r = client.post(f"{urls[target]}/v1/completions", json=body)
                    elapsed = time.perf_counter() - t0
                    r.raise_for_status()
                    if r.json()["choices"][0]["finish_reason"] != "length":
                        raise RuntimeError(f"{target}: {r.text}")
                    if rep:
                        results[target].append(elapsed)
        return statistics.median(results["single"]), statistics.median(results["pd"])
    finally:
        procs.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k and 4k tokens, fewer repeats")
    ap.add_argument("--part", choices=["all", "bandwidth", "ttft"], default="all")
    ap.add_argument("--tokens", default=None, help="prompt lengths for (a), e.g. 1024,16384")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--chunk-mib", type=float, default=8, help="max message size, MiB")
    ap.add_argument("--in-flight-mib", type=float, default=32, help="bytes in flight each way")
    ap.add_argument(
        "--placement",
        default="random,contiguous",
        help=f"comma-separated, of {PLACEMENTS}: where a request's blocks are (see block_ids)",
    )
    ap.add_argument("--ttft-prompt-len", type=int, default=2048)
    ap.add_argument("--send-type", default="PUT_ASYNC", choices=["PUT", "PUT_ASYNC", "GET"])
    args = ap.parse_args()
    quick = args.quick
    tokens = (
        [int(t) for t in args.tokens.split(",")]
        if args.tokens
        else ([1024, 4096] if quick else [1024, 2048, 4096, 8192, 16384])
    )
    repeats = args.repeats or (3 if quick else 5)
    print(f"machine: {machine_info()}")
    if args.part in ("all", "bandwidth"):
        for placement in args.placement.split(","):
            if placement not in PLACEMENTS:
                ap.error(f"--placement: {placement!r} is not one of {PLACEMENTS}")
            print(
                f"(a) KV transfer P -> D, {NUM_LAYERS} layers x {NUM_KV_HEADS} KV heads x "
                f"{HEAD_SIZE} x fp16 ({BYTES_PER_TOKEN // 1024} KiB/token), blocks of "
                f"{BLOCK_SIZE} placed {placement}, messages <= {args.chunk_mib:g} MiB, "
                f"{args.in_flight_mib:g} MiB in flight, median of {repeats}"
            )
            run_bandwidth(
                tokens,
                repeats,
                int(args.chunk_mib * 2**20),
                int(args.in_flight_mib * 2**20),
                placement,
            )
    if args.part in ("all", "ttft"):
        n = 5 if quick else 10
        print(
            f"(b) TTFT, {args.ttft_prompt_len}-token prompts, small Llama (19M, fp32 on CPU), "
            f"1P1D {args.send_type} behind the proxy vs one instance, median of {n}"
        )
        single, pd = run_ttft(args.ttft_prompt_len, n, args.send_type)
        print(
            f"  single instance {single * 1000:7.1f} ms   1P1D via proxy {pd * 1000:7.1f} ms   "
            f"overhead {100 * (pd / single - 1):+5.1f} %"
        )


if __name__ == "__main__":
    main()

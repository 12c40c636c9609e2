"""One side (P or D) of ``benchmarks/pd_transfer.py``'s bandwidth test, in its own process.

Each side holds one paged KV cache and, per data path, a ``LaneStack``: a control plane, a
``PairGroups`` with that path's ``same_host_transport`` and this side's lane over the pair's
group (P: a ``SendLane``, D: a ``ReceiveLane``), plus one raw loopback TCP socket. Commands
come from the parent as JSON over a pipe: ``connect``, then transfers
(``{"op", "num_blocks", "seed"}``, answered ``armed``, started by ``go``, answered with the
side's start and end times), then ``stop``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import torch

#: The KV of one prompt: 32 layers, 8 KV heads, head size 128, fp16 = 128 KiB per token.
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.float16
BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE * 2

#: Blocks per run in the "runs" placement: a free queue handing out runs of consecutive
#: blocks, the runs themselves anywhere in the cache (a fragmented pool).
RUN_BLOCKS = 16
PLACEMENTS = ("random", "runs", "contiguous")

#: Transfer ops over the lanes: name -> (data path, raw). A raw op sends the same messages
#: from one ready run of blocks (no gather on P) and D drains them into staging (no scatter).
LANE_OPS = {
    "shm": ("shm", False),
    "gloo": ("network", False),
    "shm-raw": ("shm", True),
    "gloo-raw": ("network", True),
}


def block_ids(num_cache_blocks: int, n: int, placement: str, gen: torch.Generator) -> torch.Tensor:
    """``n`` block ids in [1, num_cache_blocks), a different draw on each side:
    "random"      every block anywhere (worst case: every message gathered and scattered)
    "runs"        runs of RUN_BLOCKS anywhere (a message spans several runs)
    "contiguous"  one range at a random offset (a fresh pool: D receives in place)"""
    if placement == "random":
        return torch.randperm(num_cache_blocks - 1, generator=gen)[:n] + 1
    if placement == "contiguous":
        return torch.randint(0, num_cache_blocks - n, (1,), generator=gen) + torch.arange(n) + 1
    num_runs = (num_cache_blocks - 1) // RUN_BLOCKS
    starts = torch.randperm(num_runs, generator=gen)[: -(-n // RUN_BLOCKS)]
    return (starts[:, None] * RUN_BLOCKS + torch.arange(RUN_BLOCKS)).flatten()[:n] + 1


def layer_caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    """One paged cache per layer; ``fill``: block b of layer l holds (b + l) % 1024, exact in
    fp16 and checkable on D."""
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    caches = []
    for layer in range(NUM_LAYERS):
        cache = torch.zeros(shape, dtype=DTYPE)
        if fill:
            values = (torch.arange(num_blocks) + layer) % 1024
            cache.copy_(values.view(1, -1, 1, 1, 1).to(DTYPE).expand(shape))
        caches.append(cache)
    return caches


class Load:
    """A receive target, as D's load records are (``cancelled``: received, not stored)."""

    def __init__(self, cancelled: bool) -> None:
        self.lock = threading.Lock()
        self.cancelled = cancelled
        self.posted = 0


class LaneStack:
    """One data path between the two processes: control plane, pair groups, this side's lane."""

    def __init__(self, role: str, path: str, ports: dict[str, int], args: dict) -> None:
        from pagedkv.kv_transfer.p2p.pair_group import PairGroups
        from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES, Hello, StoreSet, XferBegin
        from pagedkv.transport.codec import Codec
        from pagedkv.transport.control_plane import ControlPlane
        from pagedkv.transport.peer_addr import PeerAddr

        other_role = "D" if role == "P" else "P"
        self.role, self.args = role, args
        self.me = PeerAddr(f"{role}-{path}", "127.0.0.1", ports[role])
        self.other = PeerAddr(f"{other_role}-{path}", "127.0.0.1", ports[other_role])
        handlers = {
            Hello: lambda peer, m: self.groups.on_hello(peer, m),
            StoreSet: lambda peer, m: self.groups.on_store_set(peer, m),
            XferBegin: lambda peer, m: self._receive(m),
        }
        codec = Codec("bench", None, 1 << 20, MESSAGE_TYPES)
        self.plane = ControlPlane(codec, self.me, handlers, name=self.me.engine_id)
        # As the connector sizes it: a ring holds the bytes in flight, at least two messages.
        ring = max(args["in_flight_bytes"], 2 * args["chunk_bytes"])
        self.groups = PairGroups(
            self.me, self.plane.send, 30, 60, same_host_transport=path, ring_capacity=ring
        )
        self.plane.start()
        self.lane: Any = None
        #: D: where the current transfer lands (target, layers) and what a drain sizes by.
        self.target: tuple[Load, list] | None = None
        self.drain: list = []
        self.received = threading.Event()
        self.error: Exception | None = None

    def _receive(self, begin: Any) -> None:
        """D: a batch announced by P, for the lane (a handler's return value is an answer)."""
        self.lane.submit(begin)

    def _received(self, error: Exception | None) -> None:
        """D: the transfer's last message is in, or it failed (``error``)."""
        self.error = error
        self.received.set()

    def connect(self) -> str:
        """Set up the pair group (D initiates, as on a first WANT) and start this side's lane;
        the kind of its wire."""
        from pagedkv.kv_transfer.p2p.shm_lanes import lane_classes

        group = self.groups.ensure(self.other) if self.role == "D" else self._wait_group()
        if not group.ready.wait(30) or group.error is not None:
            raise TimeoutError(f"pair group not ready: {group.error}")
        wire = group.wire
        send_lane, receive_lane = lane_classes(wire)
        in_flight = self.args["in_flight_bytes"]
        if self.role == "D":
            self.lane = receive_lane(
                wire, lambda xfer: self.target, lambda xfer: self.drain,
                lambda target, n, error: self._received(error),
                lambda reason: print("D lane broken:", reason), in_flight, 60, "bench-recv",
            )  # fmt: skip
        else:
            self.lane = send_lane(
                wire, group.name, NUM_LAYERS, lambda begin: self.plane.send(self.other, begin),
                lambda job: None, lambda reason: print("P lane broken:", reason), in_flight, 60,
                "bench-send",
            )  # fmt: skip
        self.lane.start()
        return wire.kind if group.fallback is None else f"{wire.kind} ({group.fallback})"

    def _wait_group(self) -> Any:
        deadline = time.monotonic() + 30
        while (group := self.groups.get(self.other.engine_id)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("no pair group from D")
            time.sleep(0.01)
        return group

    def close(self) -> None:
        if self.lane is not None:
            self.lane.stop("done")
            self.lane.join(10)  # the group goes with the lane's thread, before the interpreter
        self.groups.close()
        self.plane.close()


class BenchPeer:
    """One side's caches, lane stacks and TCP socket, driven by the parent's commands."""

    def __init__(self, role: str, conn: Any, args: dict) -> None:
        from pagedkv.kv_transfer.p2p.send_modes import SendContext
        from pagedkv.kv_transfer.p2p.send_pool import SendPool
        from pagedkv.kv_transfer.p2p.transfer import (
            block_bytes,
            chunk_blocks_for,
            min_run_blocks_for,
        )

        torch.set_num_threads(args["threads"])
        self.role, self.conn, self.args = role, conn, args
        self.num_blocks = args["max_blocks"] + 1
        self.caches = layer_caches(self.num_blocks, fill=role == "P")
        self.ctx = SendContext(self.caches, [0] * NUM_LAYERS, BLOCK_SIZE, SendPool(0), 60)
        self.chunk_blocks = chunk_blocks_for(block_bytes(self.caches[0]), args["chunk_bytes"])
        self.min_run_blocks = min_run_blocks_for(block_bytes(self.caches[0]), self.chunk_blocks)
        self.stacks = {
            path: LaneStack(role, path, args["ports"][path], args) for path in args["paths"]
        }
        self.tcp = socket.socket()
        self.peer_sock: socket.socket | None = None
        if role == "D":
            self.tcp.bind(("127.0.0.1", args["tcp_port"]))
            self.tcp.listen(1)

    def reply(self, message: dict) -> None:
        self.conn.send(json.dumps(message))

    def serve(self) -> None:
        self.reply({"ready": True})
        try:
            while (command := json.loads(self.conn.recv()))["op"] != "stop":
                try:
                    if command["op"] == "connect":
                        self.reply({"kinds": self.connect()})
                    else:
                        self.reply(self.transfer(command))
                except Exception as e:  # the parent raises it, naming this side
                    self.reply({"error": f"{type(e).__name__}: {e}"})
                    raise
        finally:
            for stack in self.stacks.values():
                stack.close()
            if self.peer_sock is not None:
                self.peer_sock.close()

    def connect(self) -> dict[str, str]:
        kinds = {path: stack.connect() for path, stack in self.stacks.items()}
        if self.role == "D":
            self.peer_sock, _ = self.tcp.accept()
        else:
            self.tcp.connect(("127.0.0.1", self.args["tcp_port"]))
            self.peer_sock = self.tcp
        self.peer_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return kinds

    def transfer(self, command: dict) -> dict:
        """Arm, wait for "go", move one prompt's KV by ``command["op"]``; the side's times."""
        from pagedkv.kv_transfer.p2p.transfer import (
            LayerBlocks,
            plan_segments,
            plan_segments_at_runs,
        )

        op, n = command["op"], command["num_blocks"]
        gen = torch.Generator().manual_seed(command["seed"])
        # Where the request's blocks are on each side (never the null block): see block_ids.
        src_ids, dst_ids = (
            block_ids(self.num_blocks, n, self.args["placement"], gen) for _ in "PD"
        )
        # D's plan, as InboundTransfers makes it: over gloo cut where D's ids break around
        # runs received in place, over shared memory in chunks.
        if op.startswith("shm"):
            segments = [plan_segments(n, self.chunk_blocks)]
        else:
            ids = dst_ids.tolist()
            segments = [plan_segments_at_runs(ids, self.chunk_blocks, self.min_run_blocks)]
        stack = self.stacks[LANE_OPS[op][0]] if op in LANE_OPS else None
        raw = op in LANE_OPS and LANE_OPS[op][1]
        if stack is not None and self.role == "D":
            layers = [LayerBlocks(cache, dst_ids, segments[0]) for cache in self.caches]
            stack.target, stack.drain = (Load(cancelled=raw), layers), layers
            stack.received.clear()
            stack.error = None
        self.reply({"armed": True})
        json.loads(self.conn.recv())  # "go"
        t0 = time.monotonic()
        if stack is None:
            self._tcp_transfer(n)
        elif self.role == "P":
            self._send(stack, command["seed"], torch.arange(1, n + 1) if raw else src_ids, segments)
        elif not stack.received.wait(300):
            raise TimeoutError(f"{op}: D received nothing in 300 s")
        elif stack.error is not None:
            raise stack.error
        t1 = time.monotonic()
        check = None
        if self.role == "D" and stack is not None and not raw:  # blocks landed where D wanted
            expected = ((src_ids + NUM_LAYERS - 1) % 1024).to(DTYPE)
            check = bool(torch.equal(self.caches[-1][1, dst_ids, -1, -1, -1], expected))
        return {"t0": t0, "t1": t1, "check": check}

    def _send(self, stack: LaneStack, seed: int, ids: torch.Tensor, segments: list) -> None:
        from pagedkv.kv_transfer.p2p.lanes import Job
        from pagedkv.kv_transfer.p2p.send_modes import HeldSource

        job = Job(f"t{seed}", segments, HeldSource(self.caches, self.ctx, [ids], segments), 0)
        stack.lane.submit([job])
        if not job.ended.wait(300):
            raise TimeoutError("P's job did not end in 300 s")
        if job.error is not None:
            raise job.error

    def _tcp_transfer(self, n: int) -> None:
        """The same bytes as one contiguous run per layer and K/V: sendall / recv_into."""
        assert self.peer_sock is not None
        for cache in self.caches:
            for kv in (0, 1):
                view = memoryview(cache[kv, :n].view(torch.uint8).numpy()).cast("B")
                if self.role == "P":
                    self.peer_sock.sendall(view)
                    continue
                got = 0
                while got < len(view):
                    got += self.peer_sock.recv_into(view[got:])


def run_peer(role: str, conn: Any, args: dict) -> None:
    """A spawned process's entry point."""
    BenchPeer(role, conn, args).serve()

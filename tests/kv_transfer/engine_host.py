"""EngineHost: an LLMEngine stepping in its own (spawned) process, driven over a pipe.

P and D must run concurrently in separate processes, as in production, so a test can kill one.
The child steps its engine on a thread whenever it has work; the parent sends JSON commands
(no pickle on the pipe either). Every wait has a timeout; ``close`` always reaps the child.

Test hooks (``hook=``), applied inside the child only:
  "die_mid_transfer"  P SIGKILLs itself right after D received its first KV message
  "die_mid_receive"   D SIGKILLs itself right after it took its first KV message (shared memory)
  "boot_id:<id>"      this engine reports another boot id (a peer on "another host")
  "die_after_want"    D exits 0.3 s after it sent its first WANT
  "slow_step:<s>"     every step that computes something takes s seconds longer (a busy P:
                      its queue drains slowly while its control plane answers as usual)
  control-plane faults, comma-separated, on the messages this engine sends:
  "drop:<kind>@<n>"       the n-th message of that kind (1-based) is never sent
  "delay:<kind>@<n>:<s>"  the n-th message of that kind leaves s seconds late (so later
                          messages of other kinds overtake it)
  (kinds as in protocol.MESSAGE_TYPES: want, xfer_begin, done, nack, cancel, heartbeat...)
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tests.ports import free_port

_START_TIMEOUT_S = 120


def p2p_config(role: str, engine_id: str, port: int | None = None, **extra: Any) -> dict:
    """A kv_transfer_config for the P2P connector (extra keys: ``kv_*`` fields go top level)."""
    top = {k: extra.pop(k) for k in list(extra) if k.startswith("kv_")}
    return {
        "kv_connector": "P2pConnector",
        "kv_role": role,
        "kv_port": port or free_port(),
        "engine_id": engine_id,
        "kv_connector_extra_config": {"heartbeat_s": 0.5, **extra},
        **top,
    }


def _fault_control_plane(spec: str) -> None:
    """Drop or delay some of this engine's outgoing control messages (module docstring)."""
    from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES
    from pagedkv.transport.control_plane import ControlPlane

    kinds = {cls: kind for kind, cls in MESSAGE_TYPES.items()}
    faults: dict[tuple[str, int], float | None] = {}  # (kind, n) -> delay, or None: drop
    for fault in spec.split(","):
        action, target, *seconds = fault.split(":")
        kind, n = target.split("@")
        assert kind in MESSAGE_TYPES and action in ("drop", "delay"), fault
        faults[kind, int(n)] = float(seconds[0]) if action == "delay" else None
    sent: collections.Counter[str] = collections.Counter()
    original_send = ControlPlane.send

    def faulty_send(self, peer, message) -> bool:
        kind = kinds[type(message)]
        sent[kind] += 1
        if (kind, sent[kind]) not in faults:
            return original_send(self, peer, message)
        delay = faults[kind, sent[kind]]
        if delay is None:
            logging.getLogger("fault").warning("dropped %s to %s", message, peer)
        else:
            threading.Timer(delay, original_send, args=(self, peer, message)).start()
        return True  # the sender believes it went out

    ControlPlane.send = faulty_send


def _apply_hook(hook: str) -> None:
    from pagedkv.kv_transfer.p2p import inbound, lanes, same_host, shm_lanes, shm_ring

    if hook.startswith(("drop:", "delay:")):
        _fault_control_plane(hook)
    elif hook.startswith("slow_step:"):
        from pagedkv.worker.model_runner import ModelRunner

        seconds, original_run = float(hook.split(":")[1]), ModelRunner._run

        def slow_run(self, scheduler_output, grammar_bitmask):
            if not scheduler_output.is_empty:
                time.sleep(seconds)
            return original_run(self, scheduler_output, grammar_bitmask)

        ModelRunner._run = slow_run
    elif hook == "die_mid_transfer":  # one message in flight at a time: the rest never leave
        original_init, original_complete = lanes.SendLane.__init__, lanes.SendLane._complete_oldest

        def one_in_flight(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self._in_flight_bytes = 1

        def complete_then_die(self):
            original_complete(self)
            os.kill(os.getpid(), signal.SIGKILL)

        def publish_then_die(self, *args, **kwargs):  # shared memory: once D has taken it
            original_publish(self, *args, **kwargs).work.wait(datetime.timedelta(seconds=30))
            os.kill(os.getpid(), signal.SIGKILL)

        original_publish = shm_lanes.ShmSendLane._send_message
        lanes.SendLane.__init__ = one_in_flight
        lanes.SendLane._complete_oldest = complete_then_die
        shm_lanes.ShmSendLane._send_message = publish_then_die
    elif hook == "die_mid_receive":  # D: SIGKILLed once it took its first KV message
        original_release = shm_ring.ShmRing.release

        def release_then_die(self):
            original_release(self)
            os.kill(os.getpid(), signal.SIGKILL)

        shm_ring.ShmRing.release = release_then_die
    elif hook.startswith("boot_id:"):  # as if on another host (or after a reboot)
        same_host.boot_id = lambda: hook.split(":", 1)[1]
    elif hook == "die_after_want":
        original_load = inbound.InboundTransfers.on_load

        def load_then_die(self, spec):
            original_load(self, spec)
            threading.Timer(0.3, os._exit, args=(0,)).start()

        inbound.InboundTransfers.on_load = load_then_die
    else:
        raise ValueError(f"unknown hook {hook!r}")


def _output_dict(out) -> dict:
    completion = out.outputs[0]
    return {
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "error": out.error,
        "kv_transfer_params": out.kv_transfer_params,
    }


def _child(conn, model: str, engine_kwargs: dict, hook: str | None, log_path: str) -> None:
    logging.basicConfig(
        filename=log_path,
        level=logging.INFO,
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    from pagedkv.engine.engine_args import EngineArgs
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.request_input import RequestInput
    from pagedkv.sampling_params import SamplingParams

    if hook:
        _apply_hook(hook)
    engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))
    lock = threading.Lock()
    finished: dict[str, dict] = {}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                busy = engine.has_unfinished_requests()
                outputs = engine.step() if busy else []
                for out in outputs:
                    if out.finished:
                        finished[out.request_id] = _output_dict(out)
            if not busy:
                time.sleep(0.002)

    threading.Thread(target=loop, daemon=True).start()
    conn.send_bytes(b'{"ready": true}')
    while True:
        command = json.loads(conn.recv_bytes())
        op = command["op"]
        with lock:
            if op == "add":
                engine.add_request(
                    RequestInput(
                        command["prompt"],
                        SamplingParams(**command["sampling"]),
                        request_id=command["request_id"],
                        kv_transfer_params=command.get("kv_transfer_params"),
                    )
                )
                reply: Any = True
            elif op == "poll":
                reply = {rid: finished.get(rid) for rid in command["request_ids"]}
            elif op == "abort":
                engine.abort_request(command["request_id"])
                reply = True
            elif op == "reset_prefix_cache":
                reply = engine.reset_prefix_cache()
            elif op == "stats":
                connector = engine.model_runner.kv_connector
                assert connector is not None
                reply = {
                    "num_prompt_tokens": engine.get_stats().num_prompt_tokens,
                    "num_preemptions": engine.get_stats().num_preemptions,
                    "fingerprint": engine.description.identity.fingerprint,
                    "kv_cache_usage": engine.kv_cache_manager.usage,
                    "unfinished": engine.has_unfinished_requests(),
                    "kv_paths": engine.kv_paths(),
                    "connector": {  # both halves'; histograms left out (not JSON)
                        name: value
                        for name, value in engine.get_kv_connector_stats().items()
                        if isinstance(value, int | float)
                    },
                }
            elif op == "shutdown":
                stop.set()
                engine.shutdown()
                conn.send_bytes(b"true")
                logging.shutdown()
                os._exit(0)  # sockets are closed: skip the slow interpreter teardown
            else:
                reply = {"error": f"unknown op {op}"}
        conn.send_bytes(json.dumps(reply).encode())


class EngineHost:
    def __init__(
        self,
        model: str | Path,
        log_dir: Path,
        name: str,
        hook: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        engine_kwargs.setdefault("max_num_seqs", 16)
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.kv_transfer_config = engine_kwargs.get("kv_transfer_config")
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child,
            args=(child_conn, str(model), engine_kwargs, hook, str(self.log_path)),
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self._ready = False  # the engine boots in the background: start several, then use them

    def wait_ready(self) -> None:
        if not self._ready:
            self._ready = True
            self._call_raw(None, _START_TIMEOUT_S)

    @property
    def kv_address(self) -> dict:
        """kv_transfer_params fields that point at this instance's KV."""
        cfg = self.kv_transfer_config
        return {
            "remote_host": "127.0.0.1",
            "remote_port": cfg["kv_port"],
            "remote_engine_id": cfg["engine_id"],
        }

    def _call_raw(self, command: dict | None, timeout_s: float) -> Any:
        if command is not None:
            self._conn.send_bytes(json.dumps(command).encode())
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no reply in {timeout_s}s (log: {self.log_path})")
        return json.loads(self._conn.recv_bytes())

    def call(self, op: str, timeout_s: float = 30, **kwargs: Any) -> Any:
        self.wait_ready()
        return self._call_raw({"op": op, **kwargs}, timeout_s)

    def add(
        self,
        request_id: str,
        prompt: list[int],
        kv_transfer_params: dict | None = None,
        **sampling: Any,
    ) -> None:
        sampling = {"temperature": 0, "ignore_eos": True, **sampling}
        self.call(
            "add",
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            kv_transfer_params=kv_transfer_params,
        )

    def wait(self, request_ids: list[str], timeout_s: float = 30) -> dict[str, dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            outs = self.call("poll", request_ids=request_ids)
            if all(outs.values()):
                return outs
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: requests not finished: {outs}")
            time.sleep(0.02)

    def stats(self) -> dict:
        return self.call("stats")

    def wait_settled(self, timeout_s: float = 15) -> dict:
        """Until no request runs or holds blocks: every transfer reached its terminal state."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if not stats["unfinished"] and stats["kv_cache_usage"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: not settled: {stats}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(TimeoutError, OSError, EOFError):
                self.call("shutdown", timeout_s=10)
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()
        self._conn.close()

"""A tensor-parallel worker rank: ``python -m pagedkv.executor.worker_proc`` (the executor starts
it; its ``WorkerStart`` arrives on stdin).

It meets the other ranks, builds its ``ModelRunner`` (its shard of the model, its own KV heads),
says ``Ready``, then runs each command the executor broadcasts until ``Shutdown``. It never
outlives the engine: it dies with its parent (``PR_SET_PDEATHSIG``), and it ignores SIGINT and
SIGTERM, which the engine process handles for all its ranks (a Ctrl-C or a service manager's
SIGTERM reaches the whole process group: the engine drains, then tells its ranks to stop). Any
error ends the process after a one-line ``Failed``: the executor then fails the engine.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec
import numpy as np

from pagedkv.distributed.shard import TPLayout
from pagedkv.distributed.tp_group import init_tp_group
from pagedkv.executor.connector_codec import decode_plain, encode_output
from pagedkv.executor.messages import (
    COMMANDS,
    AttachConnector,
    Done,
    Execute,
    Failed,
    InitKVCache,
    Ready,
    ReplyChannel,
    Shutdown,
    WarmUp,
    WorkerStart,
)
from pagedkv.executor.shm_broadcast import ShmBroadcast
from pagedkv.kv_cache.kv_cache_config import get_kv_cache_config
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_transfer.factory import create_worker_connector
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.scheduler_output import GrammarBitmask

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL when the engine process ends, however it ends (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the line above
        os._exit(1)


def worker_config(fields: dict) -> WorkerConfig:
    return WorkerConfig(**{**fields, "model_path": Path(fields["model_path"])})


def grammar_bitmask(command: Execute) -> GrammarBitmask | None:
    if command.grammar_req_ids is None:
        return None
    assert command.grammar_bitmask is not None and command.grammar_shape is not None
    words = np.frombuffer(command.grammar_bitmask, dtype=np.int32)
    return GrammarBitmask(command.grammar_req_ids, words.reshape(command.grammar_shape))


class WorkerRank:
    """One rank's runner and the commands it runs."""

    def __init__(self, start: WorkerStart) -> None:
        self.start = start
        tp = init_tp_group(
            start.rank, start.world_size, start.store_path, start.collective_timeout_s
        )
        self.tp = tp
        self.runner = ModelRunner(worker_config(start.worker_config), tp)

    def run(self, command) -> Done:
        runner = self.runner
        if isinstance(command, Execute):
            runner.accept_sampled_tokens(command.sampled_req_ids, command.sampled_token_ids)
            scheduler_output = command.scheduler_output
            scheduler_output.kv_connector_metadata = decode_plain(command.connector_metadata)
            output = runner.execute_model(scheduler_output, grammar_bitmask(command))
            return Done(encode_output(output.kv_connector_output))
        if isinstance(command, InitKVCache):
            specs = runner.get_kv_cache_specs(command.block_size)
            config = get_kv_cache_config(specs, num_gpu_blocks_override=command.num_blocks)
            runner.initialize_kv_cache(config)
        elif isinstance(command, WarmUp):
            runner.warm_up()
        elif isinstance(command, AttachConnector):
            layout = TPLayout(self.tp.rank, self.tp.world_size, command.num_kv_heads)
            config = KVTransferConfig.from_dict(command.kv_transfer_config)
            connector = create_worker_connector(
                config, runner.kv_cache_config, command.model_fingerprint, layout
            )
            runner.set_kv_connector(connector)
        return Done()

    def shutdown(self) -> None:
        """The connector, then the group (a gloo group left to the interpreter's exit can
        abort the process)."""
        if self.runner.kv_connector is not None:
            self.runner.kv_connector.shutdown()
        self.tp.close()


def serve(start: WorkerStart, replies: ReplyChannel) -> None:
    """Build the rank, then run commands until ``Shutdown``."""
    rank = WorkerRank(start)
    replies.send(Ready())
    broadcast = ShmBroadcast(start.broadcast_fd, start.world_size - 1, start.rank - 1)
    try:
        while True:
            command = COMMANDS.decode(broadcast.receive(start.wake_fd))
            if isinstance(command, Shutdown):
                break
            replies.send(rank.run(command))
    finally:
        rank.shutdown()
    replies.send(Done())


def main() -> None:
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    start = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerStart)
    logging.basicConfig(
        level=start.log_level,
        format=f"%(levelname)s rank{start.rank} %(name)s: %(message)s",
    )
    os.set_blocking(start.wake_fd, False)
    replies = ReplyChannel(start.reply_fd)
    try:
        serve(start, replies)
    except BaseException as e:
        logger.exception("tensor-parallel rank %d failed", start.rank)
        replies.send(Failed(f"{type(e).__name__}: {e}".splitlines()[0]))
        sys.exit(1)


if __name__ == "__main__":
    main()

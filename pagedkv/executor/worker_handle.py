"""WorkerHandle: the executor's side of one worker rank: its process, wake-up pipe and replies."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import msgspec

from pagedkv.executor.messages import ReplyChannel, WorkerStart
from pagedkv.worker.config import WorkerConfig

#: How long a rank that was told to stop may take before it is killed.
STOP_TIMEOUT_S = 10.0


class WorkerHandle:
    def __init__(
        self,
        rank: int,
        world_size: int,
        config: WorkerConfig,
        store_path: str,
        collective_timeout_s: float,
        broadcast_fd: int,
        log_level: str,
    ) -> None:
        self.rank = rank
        wake_r, self.wake_fd = os.pipe()
        reply_r, reply_w = os.pipe()
        fields = dataclasses.asdict(config) | {"model_path": str(config.model_path)}
        start = WorkerStart(
            rank=rank,
            world_size=world_size,
            store_path=store_path,
            collective_timeout_s=collective_timeout_s,
            worker_config=fields,
            broadcast_fd=broadcast_fd,
            wake_fd=wake_r,
            reply_fd=reply_w,
            log_level=log_level,
        )
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedkv.executor.worker_proc"],
                stdin=subprocess.PIPE,
                pass_fds=(broadcast_fd, wake_r, reply_w),
            )
        finally:
            os.close(wake_r)
            os.close(reply_w)
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(start))
        self.proc.stdin.close()
        os.set_blocking(self.wake_fd, False)
        self.replies = ReplyChannel(reply_r)
        #: Readable once the process has exited (``select``).
        self.pidfd = os.pidfd_open(self.proc.pid)

    @property
    def name(self) -> str:
        return f"tensor-parallel rank {self.rank} (pid {self.proc.pid})"

    def exit_reason(self) -> str | None:
        """How the process ended ("exit code 1", "killed by SIGKILL"), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self) -> None:
        """Wait for the process to end (it was told to), killing it after ``STOP_TIMEOUT_S``;
        close every descriptor."""
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.wake_fd, self.replies.fd, self.pidfd):
            os.close(fd)

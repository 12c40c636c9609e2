"""ShmBroadcast between real processes: every reader gets every message, whole and in order,
whatever its size (one slot or many) and however far the writer runs ahead (it waits for the
slowest reader); a closed broadcast or a closed wake-up pipe ends a reader's wait."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.executor.shm_broadcast import NUM_SLOTS, SLOT_BYTES, ShmBroadcast, create_segment

READER = Path(__file__).with_name("broadcast_reader.py")


def _start_readers(num_readers: int, count: int):
    fd = create_segment(num_readers)
    writer = ShmBroadcast(fd, num_readers)
    readers, wake_fds = [], []
    for reader in range(num_readers):
        wake_r, wake_w = os.pipe()
        argv = [sys.executable, str(READER), str(fd), str(num_readers), str(reader)]
        proc = subprocess.Popen(
            [*argv, str(wake_r), str(count)],
            stdout=subprocess.PIPE,
            text=True,
            pass_fds=(fd, wake_r),
        )
        os.close(wake_r)
        os.set_blocking(wake_w, False)
        readers.append(proc)
        wake_fds.append(wake_w)
    os.close(fd)
    return writer, readers, wake_fds


def _lines(proc: subprocess.Popen) -> list[str]:
    out, _ = proc.communicate(timeout=60)
    return out.splitlines()


@pytest.mark.parametrize("num_readers", [1, 3])
def test_every_reader_gets_every_message_whole_and_in_order(num_readers: int) -> None:
    rng = random.Random(num_readers)
    sizes = [0, 1, SLOT_BYTES - 16, SLOT_BYTES - 15, 3 * SLOT_BYTES + 5]
    sizes += [rng.randrange(1, 4096) for _ in range(4 * NUM_SLOTS)]
    messages = [rng.randbytes(size) for size in sizes]
    writer, readers, wake_fds = _start_readers(num_readers, len(messages))
    for message in messages:
        writer.publish(message, wake_fds, lambda: None)
    expected = [f"{len(m)} {hashlib.sha256(m).hexdigest()}" for m in messages]
    for proc in readers:
        assert _lines(proc) == expected
        assert proc.returncode == 0


def test_closing_the_broadcast_ends_a_readers_wait() -> None:
    writer, readers, wake_fds = _start_readers(1, 2)
    writer.publish(b"one", wake_fds, lambda: None)
    writer.close()
    os.write(wake_fds[0], b"\0")
    lines = _lines(readers[0])
    assert lines[0].startswith("3 ") and lines[1] == "closed: the executor closed the broadcast"


def test_a_closed_wake_up_pipe_ends_a_readers_wait() -> None:
    """The executor's process ended: its end of the pipe closes with it."""
    _, readers, wake_fds = _start_readers(1, 1)
    os.close(wake_fds[0])
    assert _lines(readers[0]) == ["closed: the executor's end of the wake-up pipe closed"]

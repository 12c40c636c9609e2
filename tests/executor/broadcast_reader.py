"""A reader rank of a ShmBroadcast, in its own process (the tests' worker): prints the length
and sha256 of each message it receives, one line each, until ``count`` or the broadcast ends."""

from __future__ import annotations

import hashlib
import os
import sys

from pagedkv.executor.shm_broadcast import BroadcastClosed, ShmBroadcast


def main() -> None:
    fd, num_readers, reader, wake_fd, count = (int(a) for a in sys.argv[1:6])
    os.set_blocking(wake_fd, False)
    broadcast = ShmBroadcast(fd, num_readers, reader)
    for _ in range(count):
        try:
            message = broadcast.receive(wake_fd, timeout_s=30)
        except BroadcastClosed as e:
            print(f"closed: {e}", flush=True)
            return
        print(len(message), hashlib.sha256(message).hexdigest(), flush=True)


if __name__ == "__main__":
    main()

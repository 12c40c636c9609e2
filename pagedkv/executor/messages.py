"""What the executor and its worker ranks say to each other (msgspec, no pickle).

Down, once per step through the shared-memory broadcast (``ShmBroadcast``): ``Execute`` and the
few commands around it. Up, per rank through its own pipe (``ReplyChannel``): ``Ready`` or
``Failed`` once at start, then one ``Done`` per command.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from pagedkv.worker.scheduler_output import SchedulerOutput


class WorkerStart(msgspec.Struct, frozen=True):
    """A worker rank's start-up, on its stdin: who it is, where the group meets, its channels."""

    rank: int
    world_size: int
    store_path: str
    collective_timeout_s: float
    #: ``WorkerConfig``'s fields (this rank's ``cpu_cores``).
    worker_config: dict[str, Any]
    broadcast_fd: int
    wake_fd: int
    reply_fd: int
    log_level: str


class InitKVCache(msgspec.Struct, tag=True, frozen=True):
    """Allocate the KV cache: every rank the same ``num_blocks`` of its own heads."""

    num_blocks: int
    block_size: int


class WarmUp(msgspec.Struct, tag=True, frozen=True):
    """``ModelRunner.warm_up``, every rank in step (its collectives)."""


class AttachConnector(msgspec.Struct, tag=True, frozen=True):
    """Build this rank's worker half of the KV connector ``kv_transfer_config``."""

    kv_transfer_config: dict[str, Any]
    model_fingerprint: str
    num_kv_heads: int


class Execute(msgspec.Struct, tag=True):
    """One step. ``sampled_*``: the tokens rank 0 sampled in the previous step, which the
    other ranks append before this step reads them."""

    scheduler_output: SchedulerOutput
    #: The connector's metadata (``connector_codec.encode_plain``), else None.
    connector_metadata: Any
    sampled_req_ids: list[str]
    sampled_token_ids: list[list[int]]
    grammar_req_ids: list[str] | None = None
    grammar_bitmask: bytes | None = None
    grammar_shape: tuple[int, int] | None = None


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    """Shut the connector down and exit 0."""


Command = InitKVCache | WarmUp | AttachConnector | Execute | Shutdown


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The rank built its model runner."""


class Failed(msgspec.Struct, tag=True, frozen=True):
    """The rank failed (and exits): what went wrong, in one line."""

    error: str


class Done(msgspec.Struct, tag=True):
    """A command ran; after ``Execute``, the rank's connector report (``KVConnectorOutput``'s
    fields, ``worker_meta`` through ``connector_codec``), else None."""

    kv_connector_output: dict[str, Any] | None = None


Reply = Ready | Failed | Done

COMMANDS = msgspec.msgpack.Decoder(Command)
REPLIES = msgspec.msgpack.Decoder(Reply)
ENCODER = msgspec.msgpack.Encoder()
_LENGTH_BYTES = 8


class ReplyChannel:
    """One rank's replies over a pipe: each message length-prefixed."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, reply: Reply) -> None:
        data = ENCODER.encode(reply)
        os.write(self.fd, len(data).to_bytes(_LENGTH_BYTES, "little") + data)

    def receive(self) -> Reply:
        """The next reply (blocking); EOFError when the rank closed its end (it exited)."""
        size = int.from_bytes(self._read_exactly(_LENGTH_BYTES), "little")
        return REPLIES.decode(self._read_exactly(size))

    def _read_exactly(self, size: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < size:
            data = os.read(self.fd, size - len(chunks))
            if not data:
                raise EOFError("the rank closed its reply pipe")
            chunks += data
        return bytes(chunks)

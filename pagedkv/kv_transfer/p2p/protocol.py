"""The P2P control plane's messages (see ``pagedkv.transport.codec`` for their envelope)."""

from __future__ import annotations

import msgspec


# ---------------------------------------------------------------------- pair group setup
class Hello(msgspec.Struct, frozen=True):
    """Create pair group ``group`` with me (rank 0 = the smaller engine id)."""

    group: str


class StoreSet(msgspec.Struct, frozen=True):
    """One rendezvous key of pair group ``group`` (``PairStore.set`` on the other side)."""

    group: str
    key: str
    value: bytes


# ---------------------------------------------------------------------- transfers
class Want(msgspec.Struct, frozen=True):
    """D -> P: send me these blocks of ``transfer_id`` over pair group ``group``.

    ``block_indices[g]`` are positions in the request's block table of KV cache group ``g``
    (D lacks them; D never asks for a position it holds as the null block). ``segments[g]``
    cut them into messages (lengths, summing to ``len(block_indices[g])``; see transfer.py).
    ``kv_heads``: the checkpoint's KV heads D wants of those blocks (first, count), planned
    for the tensor-parallel sizes ``tp_sizes`` (P's, D's); see head_plan.py."""

    transfer_id: str
    group: str
    num_prompt_tokens: int
    prompt_hash: str
    block_indices: list[list[int]]
    segments: list[list[int]]
    kv_heads: tuple[int, int] = (0, 0)
    tp_sizes: tuple[int, int] = (1, 1)


class XferPart(msgspec.Struct, frozen=True, array_like=True):
    """One transfer of a wire batch: its id, the segments of its WANT (per KV cache group,
    blocks per message) and the KV heads of each block sent (0: all D's rank holds), so D can
    size every message even of a transfer it forgot."""

    transfer_id: str
    segments: list[list[int]]
    num_heads: int = 0


class XferBegin(msgspec.Struct, frozen=True):
    """P -> D: a wire batch follows on pair group ``group`` with gloo tag ``tag``. Layer-major:
    for each layer, for each part in order, each segment of that layer's KV cache group as a K
    message then a V message. P sends its batches to one D one after another, in the order of
    their XFER_BEGINs, and D receives them in that order (see lanes.py)."""

    group: str
    tag: int
    parts: list[XferPart]


#: Transfers one XFER_BEGIN carries at most: P's send lane fills its wire batches up to it, D
#: refuses a larger one (it could not allocate what the batch asks for).
MAX_PARTS = 64


class Done(msgspec.Struct, frozen=True):
    """D -> P: the transfer ended on D (``ok``: every wanted block landed)."""

    transfer_id: str
    ok: bool
    reason: str = ""


class Nack(msgspec.Struct, frozen=True):
    """P -> D: P will not send this transfer (unknown, expired, pool full, aborted...).
    ``group_lost``: P has no pair group of that generation any more; D should start anew."""

    transfer_id: str
    reason: str
    group_lost: bool = False


class Cancel(msgspec.Struct, frozen=True):
    """D -> P: D no longer wants this transfer (aborted, or past its deadline)."""

    transfer_id: str
    reason: str


#: Transfers one heartbeat names as still being computed, at most (with transfer ids of up to
#: 256 characters, 1024 of them fit well within the default ``max_message_bytes``).
MAX_COMPUTING = 1024


class Heartbeat(msgspec.Struct, frozen=True):
    """Liveness, both ways, while a pair group exists. From D it also renews the leases of
    ``transfer_ids`` (loads D has asked for: P NACKs the ones it does not hold for D) and of
    ``queued`` (requests D has not admitted yet: P keeps their KV, ignoring ids it does not
    know yet). From P, ``computing`` names the transfers D asked for whose request is still
    queued or in prefill on P: D's deadline for those loads counts from when it hears this.
    At most ``MAX_COMPUTING`` of them, the oldest on P first (the ones P computes next); one
    named in no heartbeat keeps the deadline it had (counted from its last naming)."""

    transfer_ids: list[str] = []
    queued: list[str] = []
    computing: list[str] = []


class Bye(msgspec.Struct, frozen=True):
    """Pair group ``group`` is torn down on the sender's side (shutting down, idle, or the
    receiver stopped answering): tear yours down too, and fail what was in flight on it."""

    group: str
    reason: str


MESSAGE_TYPES: dict[str, type[msgspec.Struct]] = {
    "hello": Hello,
    "store_set": StoreSet,
    "want": Want,
    "xfer_begin": XferBegin,
    "done": Done,
    "nack": Nack,
    "cancel": Cancel,
    "heartbeat": Heartbeat,
    "bye": Bye,
}

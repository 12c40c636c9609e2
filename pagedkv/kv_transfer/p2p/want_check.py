"""Checks of D's WANT on P: whether it can be any request's, and whether this KV serves it.

A WANT is kept (early, before P's request reached its KV) only if it could be a request's at
all, so a flood of made-up ones costs bounded memory; it is served only to the D that P's
request allows (if it names one), and only if it names exactly the blocks of P's prompt that
D may ask for, cut into sane messages, and the KV heads P planned to send it (head_plan.py).
"""

from __future__ import annotations

from pagedkv.distributed.shard import Shard
from pagedkv.kv_cache.kv_cache_block import NULL_BLOCK_ID
from pagedkv.kv_transfer.p2p.connector import SendSpec
from pagedkv.kv_transfer.p2p.protocol import Want
from pagedkv.kv_transfer.p2p.transfer_state import Outbound
from pagedkv.transport.peer_addr import PeerAddr
from pagedkv.utils import cdiv

#: No single message may be larger, whatever a WANT asks for.
MAX_MESSAGE_BYTES = 256 << 20


def tp_problem(want: Want, tp_size: int) -> str | None:
    """Why a WANT planned for a P of another tensor-parallel size than ``tp_size`` can't be
    served (None: it was planned for this one)."""
    if want.tp_sizes[0] == tp_size:
        return None
    return (
        f"D planned for a P of {want.tp_sizes[0]} tensor-parallel ranks, this P has {tp_size} "
        f"(kv_transfer_params.remote_tp_size)"
    )


def want_size_problem(want: Want, num_groups: int, block_size: int, num_blocks: int) -> str | None:
    """Why a WANT is too big to be any request's (None: it may be one)."""
    if len(want.block_indices) != num_groups or len(want.segments) != num_groups:
        return "KV cache group count mismatch"
    most = min(cdiv(want.num_prompt_tokens, block_size), num_blocks)
    if any(
        len(indices) > most or len(segments) > len(indices)
        for indices, segments in zip(want.block_indices, want.segments)
    ):
        return "WANT names more blocks than its prompt has"
    return None


def may_serve(spec: SendSpec | None, peer: PeerAddr) -> bool:
    """Whether ``peer`` may pull this KV: P's request may name the one D that may (no
    ``spec`` yet: P's request has not reached its KV, so nobody is excluded)."""
    return spec is None or spec.expected_peer in (None, peer.engine_id)


def want_problem(
    rec: Outbound, block_size: int, half_block_bytes: int, own_heads: Shard
) -> str | None:
    """Why D's WANT can't be served from this KV, this rank holding the checkpoint's KV heads
    ``own_heads`` (None: it can)."""
    want, spec, peer = rec.want, rec.spec, rec.peer
    assert want is not None and spec is not None and peer is not None
    if not may_serve(spec, peer):
        return f"transfer is for {spec.expected_peer}, not {peer.engine_id}"
    if tuple(want.kv_heads) != tuple(spec.kv_heads or own_heads):
        return (
            f"D wants KV heads {tuple(want.kv_heads)} (first, count), P planned "
            f"{tuple(spec.kv_heads or own_heads)} (tensor-parallel sizes differ from the params?)"
        )
    if want.num_prompt_tokens != spec.num_prompt_tokens or want.prompt_hash != spec.prompt_hash:
        return "prompt mismatch: P and D hold different prompts for this transfer"
    if len(want.block_indices) != len(spec.block_ids):
        return "KV cache group count mismatch"
    num_prompt_blocks = cdiv(spec.num_prompt_tokens, block_size)
    for indices, ids in zip(want.block_indices, spec.block_ids):
        limit = min(len(ids), num_prompt_blocks)
        if any(not 0 <= i < limit or ids[i] == NULL_BLOCK_ID for i in indices):
            return "WANT names blocks outside the prompt or skipped by P's window"
    if len(want.segments) != len(want.block_indices) or any(
        sum(segments) != len(indices)
        or any(not 0 < n <= MAX_MESSAGE_BYTES // half_block_bytes for n in segments)
        for segments, indices in zip(want.segments, want.block_indices)
    ):
        return "WANT's message segments do not cut its blocks into sane messages"
    return None

"""HeadLayout: a KV cache group's blocks on one rank as store values, one per (block, KV head).

A value's payload is one KV head of one block, every layer of the group, K and V::

    payload = [cache[l][:, b, :, h] for l in group layers]   # [layers, 2, block_size, head]

where ``h`` is the rank's local index of the head. Values of several blocks are block-major:
value ``i * n + j`` is head ``j`` (of the ``n`` written or read) of block ``i``. Which heads a
rank writes and reads: ``rank_heads.py``. Bytes move as uint8, so any cache dtype round-trips.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.distributed.shard import TPLayout
from pagedkv.kv_transfer.store.block_codec import head_keys
from pagedkv.kv_transfer.store.block_layout import GroupLayout
from pagedkv.kv_transfer.store.rank_heads import RankHeads


@dataclass(frozen=True)
class HeadLayout:
    group: GroupLayout
    heads: RankHeads

    @classmethod
    def of_groups(
        cls,
        tp: TPLayout,
        kv_caches: Sequence[torch.Tensor],
        layer_groups: Sequence[int],
        num_groups: int,
    ) -> list[HeadLayout]:
        """Each KV cache group's layout on rank ``tp``, by group id."""
        groups = [GroupLayout.of_group(gid, layer_groups, kv_caches) for gid in range(num_groups)]
        return [cls(group, RankHeads.of(tp, group.layer_block_shape[2])) for group in groups]

    @property
    def payload_size(self) -> int:
        """One value's payload: one head of one block."""
        two, block_size, _, head_bytes = self.group.layer_block_shape
        return len(self.group.layer_indices) * two * block_size * head_bytes

    @property
    def num_written(self) -> int:
        return len(self.heads.written)

    @property
    def write_bytes(self) -> int:
        """Payload bytes this rank writes per block (0 when a lower rank writes its heads)."""
        return self.num_written * self.payload_size

    def write_keys(self, keys: Sequence[str]) -> list[str]:
        """The value keys this rank writes for blocks ``keys``, block-major."""
        return head_keys(keys, self.heads.written)

    def read_keys(self, keys: Sequence[str]) -> list[str]:
        """The value keys this rank reads for blocks ``keys``, block-major."""
        return head_keys(keys, self.heads.read)

    def pack(
        self, snapshot: list[torch.Tensor], rows: slice | list[int], payloads: np.ndarray
    ) -> None:
        """Write the written heads of snapshotted blocks ``rows`` (``GroupLayout.snapshot``,
        on the host) into ``payloads`` (uint8, one value per row, block-major)."""
        values = self._as_values(payloads, self.num_written)
        for j, layer_blocks in enumerate(snapshot):
            blocks = layer_blocks.view(torch.uint8).numpy()[:, rows]  # [2, n, bs, heads, hb]
            values[:, :, j] = blocks.transpose(1, 3, 0, 2, 4)[:, : self.num_written]

    def unpack(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        payloads: Sequence[memoryview],
        staging: np.ndarray,
    ) -> None:
        """Scatter verified values (every held head of each block, block-major) into the
        blocks ``block_ids``, through ``staging`` (uint8, a row of at least ``payload_size``
        bytes per value; reused by the caller, so its pages are touched once)."""
        rows = staging[: len(payloads), : self.payload_size]
        for row, payload in zip(rows, payloads):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        values = self._as_values(rows, len(self.heads.read))
        device = kv_caches[self.group.layer_indices[0]].device
        if device.type == "cpu":
            for j, layer in enumerate(self.group.layer_indices):
                cache = kv_caches[layer].view(torch.uint8).numpy()
                cache[:, block_ids] = values[:, :, j].transpose(2, 0, 3, 1, 4)
            return
        rows = torch.from_numpy(values).to(device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        for j, layer in enumerate(self.group.layer_indices):
            blocks = rows[:, :, j].permute(2, 0, 3, 1, 4)
            kv_caches[layer].view(torch.uint8).index_copy_(1, ids, blocks)
        torch.cuda.current_stream(device).synchronize()  # done only once the bytes landed

    def _as_values(self, payloads: np.ndarray, num_heads: int) -> np.ndarray:
        """Rows of values as ``[blocks, heads, layers, 2, block_size, head bytes]``."""
        two, block_size, _, head_bytes = self.group.layer_block_shape
        shape = (-1, num_heads, len(self.group.layer_indices), two, block_size, head_bytes)
        values = payloads.reshape(shape)
        assert np.may_share_memory(values, payloads), "value rows must reshape without a copy"
        return values

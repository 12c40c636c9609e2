"""GroupLayout: where one KV cache group's blocks live, and how a block becomes a payload.

The paged cache of layer ``l`` is ``[2, num_blocks, block_size, kv_heads, head_size]``. The
payload of block ``b`` of a group is its slice of every layer of the group, layer-major::

    payload = [cache[l][:, b] for l in group layers]   # [layers, 2, block_size, heads, head]

Bytes are moved as uint8, so any cache dtype (bf16 included) round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.kv_cache.kv_cache_config import KVCacheGroupSpec


def _layer_index(layer_name: str) -> int:
    """``"layers.7"`` -> 7 (the model runner's layer naming)."""
    return int(layer_name.rsplit(".", 1)[1])


@dataclass(frozen=True)
class GroupLayout:
    group_id: int
    layer_indices: tuple[int, ...]
    #: One layer's block as uint8: ``[2, block_size, kv_heads, head_size * dtype size]``.
    layer_block_shape: tuple[int, ...]

    @classmethod
    def of_group(
        cls, group_id: int, group: KVCacheGroupSpec, kv_caches: Sequence[torch.Tensor]
    ) -> GroupLayout:
        layers = tuple(_layer_index(name) for name in group.layer_names)
        shapes = {tuple(kv_caches[i].view(torch.uint8).shape) for i in layers}
        assert len(shapes) == 1, f"KV cache group {group_id} mixes cache shapes {shapes}"
        (shape,) = shapes
        return cls(group_id, layers, (shape[0], *shape[2:]))

    @property
    def payload_size(self) -> int:
        return len(self.layer_indices) * int(np.prod(self.layer_block_shape))

    def snapshot(self, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> list:
        """Copy the blocks out of the paged cache, one ``[2, n, ...]`` tensor per layer: after
        this the blocks may be freed and reused."""
        return [kv_caches[i].index_select(1, block_ids) for i in self.layer_indices]

    def pack(self, snapshot: list[torch.Tensor], payloads: np.ndarray) -> None:
        """Write each snapshotted block into one row of ``payloads`` (uint8 ``[n, size]``)."""
        rows = torch.from_numpy(payloads).view(
            len(payloads), len(self.layer_indices), *self.layer_block_shape
        )
        for j, layer_blocks in enumerate(snapshot):
            rows[:, j].copy_(layer_blocks.cpu().view(torch.uint8).transpose(0, 1))

    def unpack(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        payloads: Sequence[memoryview],
    ) -> None:
        """Scatter payloads (already verified) into the blocks ``block_ids``."""
        staging = np.empty((len(payloads), self.payload_size), dtype=np.uint8)
        for row, payload in zip(staging, payloads):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        device = kv_caches[self.layer_indices[0]].device
        rows = (
            torch.from_numpy(staging)
            .to(device)
            .view(len(payloads), len(self.layer_indices), *self.layer_block_shape)
        )
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        for j, layer in enumerate(self.layer_indices):
            kv_caches[layer].view(torch.uint8).index_copy_(1, ids, rows[:, j].transpose(0, 1))
        if device.type == "cuda":  # the load counts as done only once the bytes have landed
            torch.cuda.current_stream(device).synchronize()

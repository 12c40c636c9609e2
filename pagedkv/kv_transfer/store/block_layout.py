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


@dataclass(frozen=True)
class GroupLayout:
    group_id: int
    layer_indices: tuple[int, ...]
    #: One layer's block as uint8: ``[2, block_size, kv_heads, head_size * dtype size]``.
    layer_block_shape: tuple[int, ...]

    @classmethod
    def of_group(
        cls, group_id: int, layer_groups: Sequence[int], kv_caches: Sequence[torch.Tensor]
    ) -> GroupLayout:
        """``layer_groups``: each layer's KV cache group, by layer index."""
        layers = tuple(i for i, gid in enumerate(layer_groups) if gid == group_id)
        shapes = {tuple(kv_caches[i].view(torch.uint8).shape) for i in layers}
        assert len(shapes) == 1, f"KV cache group {group_id} mixes cache shapes {shapes}"
        (shape,) = shapes
        return cls(group_id, layers, (shape[0], *shape[2:]))

    @property
    def payload_size(self) -> int:
        return len(self.layer_indices) * int(np.prod(self.layer_block_shape))

    def snapshot(
        self, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor
    ) -> list[torch.Tensor]:
        """Copy the blocks out of the paged cache, one ``[2, n, ...]`` tensor per layer (on the
        cache's device): after this the blocks may be freed and reused."""
        return [kv_caches[i].index_select(1, block_ids) for i in self.layer_indices]

    def pack(
        self, snapshot: list[torch.Tensor], rows: slice | list[int], payloads: np.ndarray
    ) -> None:
        """Write the snapshotted blocks ``rows`` (host tensors) into ``payloads`` (uint8, one
        row per block). Copies go through numpy: torch's strided uint8 copies run at a
        fraction of memcpy speed here."""
        blocks = self._as_blocks(payloads)
        for j, layer_blocks in enumerate(snapshot):
            blocks[:, j] = layer_blocks.view(torch.uint8).numpy()[:, rows].swapaxes(0, 1)

    def unpack(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        payloads: Sequence[memoryview],
    ) -> None:
        """Scatter payloads (already verified) into the blocks ``block_ids``."""
        device = kv_caches[self.layer_indices[0]].device
        if device.type == "cpu":  # straight into the cache: one copy
            layers = [kv_caches[i].view(torch.uint8).numpy() for i in self.layer_indices]
            for block_id, payload in zip(block_ids, payloads):
                for layer, block in zip(layers, self._as_blocks(payload)):
                    layer[:, block_id] = block
            return
        staging = np.empty((len(payloads), self.payload_size), dtype=np.uint8)
        for row, payload in zip(staging, payloads):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        rows = torch.from_numpy(self._as_blocks(staging)).to(device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        for j, layer in enumerate(self.layer_indices):
            kv_caches[layer].view(torch.uint8).index_copy_(1, ids, rows[:, j].transpose(0, 1))
        torch.cuda.current_stream(device).synchronize()  # done only once the bytes landed

    def _as_blocks(self, payloads: np.ndarray | memoryview) -> np.ndarray:
        """A view of one payload (``[layers, ...]``) or of rows of them (``[n, layers, ...]``)."""
        array = np.frombuffer(payloads, np.uint8) if isinstance(payloads, memoryview) else payloads
        shape = (len(self.layer_indices), *self.layer_block_shape)
        if array.ndim == 2:
            shape = (array.shape[0], *shape)
        blocks = array.reshape(shape)
        assert np.may_share_memory(blocks, array), "payload rows must reshape without a copy"
        return blocks

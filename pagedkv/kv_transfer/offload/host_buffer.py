"""HostBuffer: the host tier's memory, one row (slot) per block, and the copies in and out.

A slot holds one block's payload in the store's layout (``store/block_layout.py``: all layers
of its group, K and V), with no header: the buffer never leaves this process. The scheduler
half assigns slots (``TierIndex``), so a slot is written only while its entry is pending and
read only while pinned by a load: the engine thread and the load threads never share one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.kv_transfer.store.block_layout import GroupLayout


class HostBuffer:
    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        #: Pages are touched on first write only: an idle host tier costs no memory.
        self.rows = np.empty((num_slots, slot_bytes), dtype=np.uint8)

    def store(
        self,
        layout: GroupLayout,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        """Copy pool blocks ``block_ids`` (one group's) into ``slots``."""
        device = kv_caches[layout.layer_indices[0]].device
        if device.type == "cpu":  # one gather and one scatter per layer, no staging
            rows = self.rows[:, : layout.payload_size].reshape(
                len(self.rows), len(layout.layer_indices), *layout.layer_block_shape
            )
            assert np.may_share_memory(rows, self.rows), "a slot's payload must reshape in place"
            for j, layer in enumerate(layout.layer_indices):
                blocks = kv_caches[layer].view(torch.uint8).numpy()[:, block_ids]
                rows[slots, j] = blocks.swapaxes(0, 1)
            return
        snapshot = layout.snapshot(kv_caches, torch.tensor(block_ids, device=device))
        snapshot = [layer_blocks.cpu() for layer_blocks in snapshot]
        staging = np.empty((len(block_ids), layout.payload_size), dtype=np.uint8)
        layout.pack(snapshot, slice(None), staging)
        self.rows[list(slots), : layout.payload_size] = staging

    def load(
        self,
        layout: GroupLayout,
        kv_caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        slots: Sequence[int],
    ) -> None:
        """Copy ``slots`` into pool blocks ``block_ids`` (one group's)."""
        size = layout.payload_size
        payloads = [memoryview(self.rows[slot, :size]) for slot in slots]
        layout.unpack(kv_caches, block_ids, payloads)

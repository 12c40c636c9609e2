"""Worker-side block tables and the slot mapping.

``BlockTable`` is a numpy array ``[max_num_reqs, max_num_blocks_per_req]`` of physical block ids
(one row per batch slot) plus each row's length. ``compute_slot_mapping`` is the one place where
a token's position becomes a KV cache slot::

    slot = block_table[row, pos // block_size] * block_size + pos % block_size

    block_size=4, row = [7, 2]     pos:  0  1  2  3 | 4  5
                                   slot: 28 29 30 31 | 8  9
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTable:
    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_num_reqs", max_num_reqs),
            ("max_num_blocks_per_req", max_num_blocks_per_req),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def _check_fits(self, row: int, num_blocks: int) -> None:
        if num_blocks > self.max_num_blocks_per_req:
            raise ValueError(
                f"row {row} would hold {num_blocks} blocks, more than max_num_blocks_per_req="
                f"{self.max_num_blocks_per_req}"
            )

    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        self._check_fits(row, end)
        self.block_table[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        self._check_fits(row, len(block_ids))
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def clear_row(self, row: int) -> None:
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row ``src`` to ``tgt`` and empty ``src`` (unless they are the same row)."""
        if src == tgt:
            return
        n = int(self.num_blocks_per_row[src])
        self.block_table[tgt, :n] = self.block_table[src, :n]
        self.num_blocks_per_row[tgt] = n
        self.num_blocks_per_row[src] = 0

    def swap_row(self, a: int, b: int) -> None:
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]
        self.block_table[[a, b]] = self.block_table[[b, a]]

    def get_row(self, row: int) -> np.ndarray:
        return self.block_table[row, : self.num_blocks_per_row[row]]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots of tokens at ``positions`` of rows ``req_indices`` (both ``[num_tokens]``)."""
        block_numbers = self.block_table[req_indices, positions // self.block_size]
        return block_numbers.astype(np.int64) * self.block_size + positions % self.block_size


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV cache group; every row operation fans out over the groups."""

    def __init__(
        self, block_sizes: Sequence[int], max_num_reqs: int, max_num_blocks: Sequence[int]
    ) -> None:
        if len(block_sizes) != len(max_num_blocks):
            raise ValueError(
                "MultiGroupBlockTable needs one max_num_blocks per block size, got "
                f"{len(block_sizes)} block sizes and {len(max_num_blocks)} max_num_blocks"
            )
        self.block_tables = [
            BlockTable(bs, max_num_reqs, n) for bs, n in zip(block_sizes, max_num_blocks)
        ]

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.block_tables[group_id]

    def __len__(self) -> int:
        return len(self.block_tables)

    def _check_block_ids(self, block_ids: Sequence[Sequence[int]]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(
                "block_ids must hold one list per group: "
                f"{len(self.block_tables)} KV cache groups, got {len(block_ids)}"
            )

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        # Check every group first: a row is written in all groups or in none.
        self._check_block_ids(block_ids)
        for table, ids in zip(self.block_tables, block_ids):
            table._check_fits(row, int(table.num_blocks_per_row[row]) + len(ids))
        for table, ids in zip(self.block_tables, block_ids):
            table.append_row(ids, row)

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        self._check_block_ids(block_ids)
        for table, ids in zip(self.block_tables, block_ids):
            table._check_fits(row, len(ids))
        for table, ids in zip(self.block_tables, block_ids):
            table.add_row(ids, row)

    def clear_row(self, row: int) -> None:
        for table in self.block_tables:
            table.clear_row(row)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, a: int, b: int) -> None:
        for table in self.block_tables:
            table.swap_row(a, b)

    def compute_slot_mapping(
        self, req_indices: np.ndarray, positions: np.ndarray
    ) -> list[np.ndarray]:
        return [t.compute_slot_mapping(req_indices, positions) for t in self.block_tables]

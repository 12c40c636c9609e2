"""Per-step attention metadata for one KV-cache group."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# A decode joins a bucket while it needs at least this fraction of the bucket's largest block
# count, so padding wastes at most a quarter of what a bucket gathers.
_DECODE_BUCKET_FILL = 0.75
# At most this many decodes share a bucket: a bucket's gathered K/V then stays in the core's
# cache until SDPA reads it (64 decodes of 350 tokens in one bucket: 2.1 ms per layer on this
# project's 2-core CPU; in buckets of 8: 1.7 ms).
_DECODE_BUCKET_MAX_ROWS = 8


@dataclass(slots=True)
class DecodeBucket:
    """Requests with a single query token and similar context lengths, attended to in one padded,
    vectorised call.

    Every row reads ``num_blocks`` blocks (the bucket's largest count) starting at the first
    block its window needs; a row that needs fewer repeats its own last block, which ``key_mask``
    hides. So a block the window skipped (possibly the null block 0) is never read.
    """

    token_indices: torch.Tensor  # int64 [num_rows]: row of each query in the flat batch
    block_ids: torch.Tensor  # int32 [num_rows * num_blocks]: physical blocks to gather
    key_mask: torch.Tensor  # bool [num_rows, 1, 1, num_blocks * block_size]


@dataclass(slots=True)
class DecodeBatch:
    """Every request with a single query token, for a kernel that reads the block table itself
    (``cpu_paged_attention``): row ``r`` attends to the keys at positions
    ``[first_keys[r], seq_lens[r])`` through ``block_table[r]``."""

    token_indices: torch.Tensor  # int64 [num_rows]: row of each query in the flat batch
    block_table: torch.Tensor  # int32 [num_rows, max_num_blocks], contiguous
    seq_lens: torch.Tensor  # int32 [num_rows]
    first_keys: torch.Tensor  # int32 [num_rows]: 0 unless a sliding window bites


@dataclass(slots=True)
class PrefillBatch:
    """Every request with several query tokens, for a kernel that reads the block table itself
    (``cpu_paged_attention``): chunk ``c`` is the ``query_lens[c]`` query tokens from row
    ``token_starts[c]`` of the flat batch, at positions ``seq_lens[c] - query_lens[c]`` to
    ``seq_lens[c] - 1``, its keys through ``block_table[c]``."""

    token_starts: torch.Tensor  # int32 [num_chunks]
    query_lens: torch.Tensor  # int32 [num_chunks]
    seq_lens: torch.Tensor  # int32 [num_chunks]
    block_table: torch.Tensor  # int32 [num_chunks, max_num_blocks], contiguous


@dataclass(slots=True)
class PrefillChunk:
    """One request with several query tokens: its queries and the blocks holding its keys.

    The gathered blocks hold keys from position ``first_block * block_size``; the visible keys
    are the ``num_keys`` slots starting at ``key_offset``. ``mask`` is None when the chunk
    starts at position 0 and no window bites, so plain ``is_causal`` is exact.
    """

    token_start: int
    token_end: int
    block_ids: torch.Tensor  # int32 [num_blocks]
    key_offset: int
    num_keys: int
    mask: torch.Tensor | None  # bool [num_queries, num_keys]


@dataclass(slots=True)
class AttentionMetadata:
    """What every attention layer of one KV-cache group needs for one step.

    For request ``i`` with ``q_len_i = query_start_loc[i+1] - query_start_loc[i]`` the queries
    are the tokens at positions ``seq_lens[i] - q_len_i … seq_lens[i] - 1``; the chunk may start
    after a prefix-cache hit. With ``sliding_window=W`` a query at position ``p`` sees the keys
    at positions ``(p - W, p]`` (W keys including itself)::

        sliding_window=4, block_size=4, seq_len=11: one decode query at position 10
        positions:  0  1  2  3 | 4  5  6  7 | 8  9 10  _
                                         |---------|  keys seen: (6, 10]
                    |--skipped-| block 0 of the table may be the null block: never read

    ``decode_batch`` and ``prefill_batch`` (for the CPU kernels) are derived from the host copies
    once per step in ``__post_init__``, because every layer of the group reads them;
    ``decode_buckets`` and ``prefill_chunks`` (for the gathering path) on first use. Decodes are
    bucketed by context length: padding every decode to the longest context would gather (and
    attend over) up to twice the keys on a typical mixed batch.
    """

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]: num_computed_tokens + num_scheduled_tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_num_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    max_query_len: int
    max_seq_len: int
    block_size: int
    sliding_window: int | None
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    decode_batch: DecodeBatch | None = field(init=False, repr=False)
    prefill_batch: PrefillBatch | None = field(init=False, repr=False)
    _decode_rows: np.ndarray = field(init=False, repr=False)
    _prefill_rows: np.ndarray = field(init=False, repr=False)
    _decode_buckets: list[DecodeBucket] | None = field(init=False, repr=False)
    _prefill_chunks: list[PrefillChunk] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        query_lens = np.diff(self.query_start_loc_cpu)
        self._decode_rows = np.flatnonzero(query_lens == 1)
        self._prefill_rows = np.flatnonzero(query_lens > 1)
        self._decode_buckets = self._prefill_chunks = None
        self.decode_batch = self._build_decode_batch(self._decode_rows)
        self.prefill_batch = self._build_prefill_batch(self._prefill_rows, query_lens)

    @property
    def prefill_chunks(self) -> list[PrefillChunk]:
        """Each request with several query tokens, for one SDPA call each (built on first use)."""
        if self._prefill_chunks is None:
            self._prefill_chunks = [self._build_prefill_chunk(int(i)) for i in self._prefill_rows]
        return self._prefill_chunks

    @property
    def decode_buckets(self) -> list[DecodeBucket]:
        """The decodes in buckets of similar context length (built on first use)."""
        if self._decode_buckets is None:
            self._decode_buckets = self._build_decode_buckets(self._decode_rows)
        return self._decode_buckets

    @classmethod
    def from_numpy(
        cls,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
        slot_mapping: np.ndarray,
        block_size: int,
        sliding_window: int | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata from host arrays, handing each one to torch exactly once."""
        query_start_loc = np.asarray(query_start_loc, dtype=np.int32)
        seq_lens = np.asarray(seq_lens, dtype=np.int32)
        query_lens = np.diff(query_start_loc)
        return cls(
            query_start_loc=torch.from_numpy(query_start_loc).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            block_table=torch.from_numpy(np.asarray(block_table, dtype=np.int32)).to(device),
            slot_mapping=torch.from_numpy(np.asarray(slot_mapping, dtype=np.int64)).to(device),
            max_query_len=int(query_lens.max(initial=0)),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=block_size,
            sliding_window=sliding_window,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )

    def _first_key_positions(self, first_query_positions: np.ndarray) -> np.ndarray:
        """First key position a query at each given position sees: ``p - W + 1`` clipped at 0."""
        if self.sliding_window is None:
            return np.zeros_like(first_query_positions)
        return np.maximum(first_query_positions - self.sliding_window + 1, 0)

    def _build_decode_batch(self, rows: np.ndarray) -> DecodeBatch | None:
        if not rows.size:
            return None
        seq_lens = self.seq_lens_cpu[rows]
        first_keys = self._first_key_positions(seq_lens - 1).astype(np.int32)
        device = self.block_table.device
        if rows.size == len(self.seq_lens_cpu):  # a pure decode step: no copy of the table
            table = self.block_table.contiguous()
        else:
            table = self.block_table[torch.from_numpy(rows).to(device)]
        return DecodeBatch(
            token_indices=torch.from_numpy(self.query_start_loc_cpu[rows].astype(np.int64)).to(
                device
            ),
            block_table=table,
            seq_lens=torch.from_numpy(np.ascontiguousarray(seq_lens)).to(device),
            first_keys=torch.from_numpy(first_keys).to(device),
        )

    def _build_prefill_batch(self, rows: np.ndarray, query_lens: np.ndarray) -> PrefillBatch | None:
        if not rows.size:
            return None
        device = self.block_table.device
        return PrefillBatch(
            token_starts=torch.from_numpy(self.query_start_loc_cpu[rows].astype(np.int32)).to(
                device
            ),
            query_lens=torch.from_numpy(query_lens[rows].astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(self.seq_lens_cpu[rows].astype(np.int32)).to(device),
            block_table=self.block_table[torch.from_numpy(rows).to(device)],
        )

    def _build_decode_buckets(self, rows: np.ndarray) -> list[DecodeBucket]:
        seq_lens = self.seq_lens_cpu[rows].astype(np.int64)
        first_keys = self._first_key_positions(seq_lens - 1)
        num_blocks = (seq_lens - 1) // self.block_size - first_keys // self.block_size + 1
        order = np.argsort(-num_blocks, kind="stable")
        buckets = []
        start = 0
        for end in range(1, len(order) + 1):
            fits = (
                end < len(order)
                and end - start < _DECODE_BUCKET_MAX_ROWS
                and num_blocks[order[end]] >= _DECODE_BUCKET_FILL * num_blocks[order[start]]
            )
            if not fits:
                members = order[start:end]
                buckets.append(
                    self._build_decode_bucket(rows[members], seq_lens[members], first_keys[members])
                )
                start = end
        return buckets

    def _build_decode_bucket(
        self, rows: np.ndarray, seq_lens: np.ndarray, first_keys: np.ndarray
    ) -> DecodeBucket:
        block_size = self.block_size
        first_blocks = first_keys // block_size
        last_blocks = (seq_lens - 1) // block_size
        num_blocks = int((last_blocks - first_blocks).max()) + 1
        columns = np.minimum(first_blocks[:, None] + np.arange(num_blocks), last_blocks[:, None])
        key_positions = first_blocks[:, None] * block_size + np.arange(num_blocks * block_size)
        key_mask = (key_positions >= first_keys[:, None]) & (key_positions < seq_lens[:, None])
        device = self.block_table.device
        block_ids = self.block_table[
            torch.from_numpy(rows).to(device)[:, None], torch.from_numpy(columns).to(device)
        ]
        token_indices = self.query_start_loc_cpu[rows].astype(np.int64)
        return DecodeBucket(
            token_indices=torch.from_numpy(token_indices).to(device),
            block_ids=block_ids.reshape(-1),
            key_mask=torch.from_numpy(key_mask[:, None, None, :]).to(device),
        )

    def _build_prefill_chunk(self, row: int) -> PrefillChunk:
        token_start = int(self.query_start_loc_cpu[row])
        token_end = int(self.query_start_loc_cpu[row + 1])
        seq_len = int(self.seq_lens_cpu[row])
        num_queries = token_end - token_start
        first_query = seq_len - num_queries
        first_key = int(self._first_key_positions(np.array(first_query)))
        first_block = first_key // self.block_size
        last_block = (seq_len - 1) // self.block_size
        num_keys = seq_len - first_key
        window_bites = self.sliding_window is not None and num_queries > self.sliding_window
        mask = None
        if first_query > 0 or window_bites:
            query_positions = np.arange(first_query, seq_len)[:, None]
            key_positions = np.arange(first_key, seq_len)[None, :]
            visible = key_positions <= query_positions
            if self.sliding_window is not None:
                visible &= key_positions > query_positions - self.sliding_window
            mask = torch.from_numpy(visible).to(self.block_table.device)
        return PrefillChunk(
            token_start=token_start,
            token_end=token_end,
            block_ids=self.block_table[row, first_block : last_block + 1],
            key_offset=first_key - first_block * self.block_size,
            num_keys=num_keys,
            mask=mask,
        )

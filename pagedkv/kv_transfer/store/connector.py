"""StoreConnector: the scheduler half of the centralized KV store connector.

Producer (``kv_producer`` / ``kv_both``): every block that becomes full in a step is listed in
that step's metadata, and the worker snapshots it for the background writer. A finished request
that queued puts holds its blocks until they have ended (``finished_sending``), so when its
caller sees the request done, its KV is in the store. A request with ``do_remote_decode`` (PD:
P) also stores its prompt's prefix-cache hits and answers ``{"do_remote_prefill": true,
"store_num_tokens": N}``, N being the prompt tokens whose blocks it put.

Consumer (``kv_consumer`` / ``kv_both``): at admission, one ``exists_all`` over the blocks past
the local prefix hit (a block is stored once each of the checkpoint's KV heads is, whichever
tensor-parallel size wrote them) finds the longest stored prefix, in whole blocks and never the
last prompt token::

    prompt (block_size 4):  [a b c d][e f g h][i j k l][m n]
    local prefix hit:       |-- hit -|
    stored in the store:             [  yes  ][  yes  ]
    last block loadable:  block (num_tokens - 1) // 4 - 1 = 2      -> load blocks 1..2
    computed locally:                                   [m n]

A sliding-window group needs only the blocks inside the window of the hit's end, so only those
must be stored. The load is async (the request waits in WAITING_FOR_REMOTE_KVS while the loader
thread fetches) or sync (``load_mode: sync``: fetched before the step's forward pass). A
request carrying P's ``store_num_tokens`` waits, up to ``remote_prefill_wait_s`` and holding no
blocks, until that many tokens are stored: P may still be writing when D gets the request.

Store faults (down, timeout, evicted, corrupt) are misses at lookup and invalid blocks at load,
which the scheduler recomputes: this connector's default ``kv_load_failure_policy`` is
``recompute``, as expected of a cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_cache.kv_cache_spec import KVCacheSpec, SlidingWindowSpec
from pagedkv.kv_connector.base import KVConnectorBase
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.params import KVTransferParams, asks_for
from pagedkv.kv_connector.protocols import ConnectorRequest
from pagedkv.kv_transfer.store.backends import StoreError, create_backend
from pagedkv.kv_transfer.store.block_codec import block_key, head_keys
from pagedkv.kv_transfer.store.completed_blocks import CompletedBlocks
from pagedkv.kv_transfer.store.config import StoreConfig
from pagedkv.kv_transfer.store.metadata import BlockRef, StoreConnectorMetadata, StoreLoad
from pagedkv.kv_transfer.store.rank_heads import checkpoint_kv_heads
from pagedkv.kv_transfer.store.stats import LOOKUP_STATS, StoreStats
from pagedkv.transport.rate_limited_log import RateLimitedLog
from pagedkv.utils import cdiv

if TYPE_CHECKING:
    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
    from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks
    from pagedkv.worker.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)
_failures = RateLimitedLog(logger)

#: How long one existence answer is reused for a request that is not admitted yet.
LOOKUP_REUSE_S = 0.05


def window_blocks(spec: KVCacheSpec) -> int | None:
    """Blocks before a hit's end that the group needs (None: all of them)."""
    if isinstance(spec, SlidingWindowSpec):
        return cdiv(spec.sliding_window - 1, spec.block_size)
    return None


def block_geometry(kv_cache_config: KVCacheConfig, connector: str) -> tuple[int, list[int | None]]:
    """The one block size of every KV cache group (KV is kept per block hash) and each group's
    window in blocks (``window_blocks``); ValueError naming ``connector`` if sizes differ."""
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    if len({spec.block_size for spec in specs}) != 1:
        raise ValueError(f"{connector} needs one block_size for every KV cache group")
    return specs[0].block_size, [window_blocks(spec) for spec in specs]


def num_kv_heads(kv_cache_config: KVCacheConfig, tp: TPLayout) -> int:
    """The checkpoint's KV heads: each is a value of its own in the store (a rank's KV cache
    spec holds its local heads only)."""
    local = {group.kv_cache_spec.num_kv_heads for group in kv_cache_config.kv_cache_groups}
    return checkpoint_kv_heads(tp, max(local))


def longest_stored_prefix(stored: list[list[bool]], windows: list[int | None]) -> int:
    """Blocks loadable from the start of ``stored`` (per group, one flag per block): every
    group must have the blocks it needs for a hit ending there."""
    num_blocks = len(stored[0])
    for end in range(num_blocks, 0, -1):
        if all(
            all(flags[0 if window is None else max(0, end - window) : end])
            for flags, window in zip(stored, windows)
        ):
            return end
    return 0


def announced_tokens(request: ConnectorRequest) -> int:
    """The prompt tokens P announced as stored (``kv_transfer_params.store_num_tokens``): 0
    when absent, or when not an integer from 0 to the prompt length (client input: warned
    about and ignored, never an exception on the scheduler thread)."""
    num_prompt = request.num_prompt_tokens
    try:
        params = KVTransferParams.parse(request.kv_transfer_params, ["store_num_tokens"])
        value = params.store_num_tokens or 0
        if value > num_prompt:
            why = f"{value} is more than the prompt's {num_prompt} tokens"
            raise ValueError(f"kv_transfer_params.store_num_tokens: {why}")
    except ValueError as e:
        logger.warning("request %s: %s; ignored", request.request_id, e)
        return 0
    return value


@dataclass(slots=True)
class _Lookup:
    start_block: int
    num_blocks: int
    checked_at: float
    first_asked_at: float
    #: P's ``store_num_tokens``, checked once per lookup (0: none, or not a valid one).
    num_announced: int = 0
    failed: bool = False


class StoreConnector(KVConnectorBase):
    default_load_failure_policy = "recompute"

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        self.store_config = StoreConfig.from_extra_config(config.kv_connector_extra_config)
        self.block_size, self.windows = block_geometry(kv_cache_config, "StoreConnector")
        self.heads = range(num_kv_heads(kv_cache_config, tp))
        self.backend = (
            create_backend(self.store_config, lookups_only=True)
            if config.kv_role.consumes
            else None
        )
        self.stats = StoreStats()
        self._saves = CompletedBlocks(self.block_size)
        #: Puts queued per request (a finished request holds its blocks until they end).
        self._num_puts: dict[str, int] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._meta = StoreConnectorMetadata()
        self._warned_no_hashes = False

    def _key(self, group_id: int, block_hash: bytes) -> str:
        return block_key(self.model_fingerprint, group_id, block_hash)

    # ------------------------------------------------------------------ consumer: lookup
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.backend is None or request.sampling_params.prompt_logprobs is not None:
            return 0, False
        start = num_computed_tokens // self.block_size
        end = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        if end <= start:
            return 0, False
        now = time.monotonic()
        lookup = self._lookups.get(request.request_id)
        if lookup is None or lookup.start_block != start:
            lookup = _Lookup(
                start,
                0,
                checked_at=-float("inf"),
                first_asked_at=now,
                num_announced=announced_tokens(request),
            )
            self._lookups[request.request_id] = lookup
        if now - lookup.checked_at > LOOKUP_REUSE_S:
            self._check_store(request, lookup, end)
            lookup.checked_at = now
        expected_end = min(lookup.num_announced // self.block_size, end)
        if (
            start + lookup.num_blocks < expected_end
            and not lookup.failed
            and now - lookup.first_asked_at < self.store_config.remote_prefill_wait_s
        ):
            return None, False  # P is still writing: look again next step
        num_tokens = lookup.num_blocks * self.block_size
        return num_tokens, num_tokens > 0 and self.store_config.load_mode == "async"

    def _check_store(self, request: ConnectorRequest, lookup: _Lookup, end: int) -> None:
        """One batched existence check over blocks ``[start, end)`` of every group."""
        assert self.backend is not None
        start, num_groups = lookup.start_block, len(self.windows)
        keys = [
            head_keys([self._key(group_id, request.block_hashes[i])], self.heads)
            for i in range(start, end)
            for group_id in range(num_groups)
        ]
        self.stats.num_lookups += 1
        try:
            exists = self.backend.exists_all(keys)
        except StoreError as e:
            self.stats.num_lookup_errors += 1
            _failures.warning("lookup", "store lookup failed, computing locally: %s", e)
            lookup.num_blocks, lookup.failed = 0, True
            return
        stored = [exists[group_id::num_groups] for group_id in range(num_groups)]
        lookup.num_blocks = longest_stored_prefix(stored, self.windows)
        lookup.failed = False

    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        lookup = self._lookups.pop(request.request_id, None)
        if not request.block_hashes and request.num_tokens >= self.block_size:
            self._warn_no_hashes()
        if self.config.kv_role.produces:
            # Allocated again after a preemption: its puts queued before still count, so its
            # blocks are held until they end (build_connector_meta takes its new blocks).
            self._saves.track(request)
        if num_external_tokens == 0:
            return
        assert lookup is not None, "external tokens without a lookup"
        start = lookup.start_block
        refs = [
            BlockRef(group_id, block.block_id, self._key(group_id, request.block_hashes[i]))
            for group_id, group_blocks in enumerate(blocks.blocks)
            for i in range(start, start + num_external_tokens // self.block_size)
            if not (block := group_blocks[i]).is_null
        ]
        self.stats.num_hit_blocks += len(refs)
        is_async = self.store_config.load_mode == "async"
        self._meta.loads.append(StoreLoad(request.request_id, refs, is_async))

    def _warn_no_hashes(self) -> None:
        if not self._warned_no_hashes:
            self._warned_no_hashes = True
            logger.warning(
                "StoreConnector: requests carry no block hashes, so nothing is stored or "
                "looked up; keys are block hashes: run with enable_prefix_caching=True"
            )

    # ------------------------------------------------------------------ producer: saves
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreConnectorMetadata:
        if self.config.kv_role.produces:
            for request, i, group_id, block_id in self._saves.step(
                scheduler_output, self._first_stored_token
            ):
                key = self._key(group_id, request.block_hashes[i])
                self._meta.saves.append((request.request_id, BlockRef(group_id, block_id, key)))
                self._num_puts[request.request_id] = self._num_puts.get(request.request_id, 0) + 1
        meta, self._meta = self._meta, StoreConnectorMetadata()
        return meta

    @staticmethod
    def _stores_whole_prompt(request: ConnectorRequest) -> bool:
        return asks_for(request.kv_transfer_params, "do_remote_decode")

    def _first_stored_token(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        """P stores its whole prompt (prefix-cache hits included); others what they compute."""
        return 0 if self._stores_whole_prompt(request) else num_computed_tokens

    # ------------------------------------------------------------------ endings
    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        self._lookups.pop(request.request_id, None)
        tracked = self._saves.forget(request.request_id)
        hold = self._num_puts.pop(request.request_id, 0) > 0
        if hold:
            self._meta.flushes.append(request.request_id)
        params = None
        if (
            tracked is not None
            and self._stores_whole_prompt(request)
            and request.status.finish_reason in ("length", "stop")
        ):
            num_blocks = min(tracked.num_done_blocks or 0, len(request.block_hashes))
            num_tokens = num_blocks * self.block_size
            params = KVTransferParams(do_remote_prefill=True, store_num_tokens=num_tokens).to_dict()
        return hold, params

    def get_kv_connector_stats(self) -> dict[str, int | float]:
        """Store lookups, lookup errors, and blocks found stored at admission."""
        return {name: getattr(self.stats, name) for name in LOOKUP_STATS}

    def cancel_load(self, request: ConnectorRequest) -> None:
        self._meta.cancels.append(request.request_id)

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.close()

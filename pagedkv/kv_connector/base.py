"""The KV connector API, in two halves that share no state (vLLM V1's split).

The scheduler half plans: which external tokens a request can load, what to send when a request
finishes, when held blocks may be freed. The worker half moves bytes. Each step one metadata
object travels down (``build_connector_meta`` -> ``bind_connector_metadata``) and one
``KVConnectorOutput`` travels up (``get_finished`` -> ``update_connector_output``).

Terminal states. Every load a consumer starts ends exactly once, reported in
``finished_recving`` (its failed blocks, if any, in ``invalid_block_ids`` of the same output);
every send a producer holds blocks for ends exactly once, reported in ``finished_sending``
(delivered, refused, failed, or its lease expired). The scheduler frees blocks only then.

Deadlines. A load counts as failed once ``load_timeout`` (``kv_load_timeout``) has passed
since it started, or since the worker last reported it in ``loads_in_progress`` (its source is
busy computing it: an overloaded producer costs time, not a failed request).

Progress. A worker half that knows when its transfers end (``signals_progress``) sets its
``progress_event`` each time one may have; an idle engine waits on that event. A composite
connector hands one event to all its children (``set_progress_event``), so any child's
transfer ending wakes the engine.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from pagedkv.distributed.shard import SINGLE_LAYOUT, TPLayout
from pagedkv.kv_connector.config import KVTransferConfig
from pagedkv.kv_connector.histogram import HistogramStat
from pagedkv.kv_connector.output import KVConnectorOutput
from pagedkv.kv_connector.protocols import (
    ConnectorRequest,
    LayerAttentionMetadata,
    ScheduledStep,
)
from pagedkv.transport.peer_addr import PeerAddr

if TYPE_CHECKING:
    import torch

    from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
    from pagedkv.kv_cache.kv_cache_manager import KVCacheBlocks
    from pagedkv.kv_cache.kv_events import KVCacheEvent


class KVConnectorMetadata:
    """Opaque per-step plan from the scheduler half to the worker half."""


class KVConnectorHalf:
    """What both halves are built from, report and do at the end."""

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config
        #: Identifies the model, dtype and KV layout: KV is only exchanged between equals.
        self.model_fingerprint = model_fingerprint
        #: The instance's tensor-parallel layout. A worker half: its rank, whose cache holds
        #: ``tp.kv_heads()`` of the checkpoint's KV heads, in the same block ids as every rank.
        #: The scheduler half (one per instance): rank 0's, for ``size`` and ``num_kv_heads``.
        self.tp = tp

    def get_kv_connector_stats(self) -> dict[str, int | float | HistogramStat]:
        """Counters (``num_*``), gauges and histograms since start, by name (both halves'
        merged, exported as ``pagedkv:kv_transfer_*``)."""
        return {}

    def shutdown(self) -> None:
        return None


class KVConnectorBase(KVConnectorHalf, ABC):
    """Scheduler half. Lives with the scheduler; never touches tensors."""

    #: ``kv_load_failure_policy`` when the config leaves it unset.
    default_load_failure_policy = "fail"

    @property
    def load_failure_policy(self) -> str:
        return self.config.kv_load_failure_policy or self.default_load_failure_policy

    def load_failure_policy_for(self, request: ConnectorRequest) -> str:
        """The policy for a failed load into ``request``'s blocks: a composite connector
        answers with the policy of the child that loads the request."""
        return self.load_failure_policy

    @property
    def load_timeout(self) -> float:
        """Seconds a load may take (``kv_load_timeout``) before it counts as failed."""
        return self.config.kv_load_timeout

    @property
    def peer_address(self) -> PeerAddr | None:
        """Where this connector pairs with peers through a proxy (P2P's control plane); None
        for one that does not pair (a store connector: its instances register as replicas)."""
        return None

    def on_new_request(self, request: ConnectorRequest) -> None:
        """A request arrived (before any admission attempt)."""
        return None

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External tokens loadable beyond the ``num_computed_tokens`` local hit, and whether
        the load is asynchronous (between steps; the request waits in WAITING_FOR_REMOTE_KVS).
        None means "not known yet, ask again next step". No side effects: may be called
        repeatedly for a request that does not get admitted."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for the request (``blocks``: all of them, per group)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: ScheduledStep) -> KVConnectorMetadata:
        """This step's plan; resets the per-step state."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' report of this step."""
        return None

    def combine_worker_meta(self, metas: list[Any]) -> Any:
        """One ``worker_meta`` of the tensor-parallel ranks' (rank order; None where a rank
        reported none). A connector whose worker half reports ``worker_meta`` says how they
        combine; by default every rank reports the same, and rank 0's stands."""
        return metas[0]

    def request_finished(
        self, request: ConnectorRequest, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        """Called once when a request ends, before its blocks are freed. Returns whether the
        connector now holds the blocks (freed when the id comes back in ``finished_sending``)
        and the ``kv_transfer_params`` for the response."""
        return False, None

    def cancel_load(self, request: ConnectorRequest) -> None:
        """Stop loading a request (aborted, or past its deadline). Its load must still end in
        ``finished_recving``, once no more bytes can land in its blocks."""
        return None

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events of the tiers this connector keeps since the last call:
        ``BlockStored`` and ``BlockRemoved``, each tagged with its tier's ``medium`` (a tier
        that drops everything says so block by block: ``AllBlocksCleared`` is the pool's
        reset, and a router clears only the pool on it). Published after the pool's own, in
        the same batch. The engine takes them every step, published or not, so a connector
        may collect them unconditionally."""
        return []

    def tier_capacities(self) -> dict[str, int]:
        """The tiers this connector keeps: per medium, how many blocks it holds at most (as
        ``tier_block_hashes`` counts them). Asked once at startup; registered with the
        proxies, which show it in ``/instances``. {}: no tier."""
        return {}

    def tier_block_hashes(self) -> dict[str, list[list[bytes]]]:
        """What the tiers hold, for a KV events snapshot: per medium, per KV cache group, the
        hash of every block (a hash twice when the tier holds two blocks under it). Called on
        the engine thread right after ``take_events``: it must equal what every event taken
        so far adds up to (no event still untaken), so a subscriber that loads it and then
        applies the following batches mirrors the tiers exactly."""
        return {}


#: How long an idle engine sleeps between polls of a worker half that does not signal progress.
POLL_S = 0.001


class KVConnectorWorker(KVConnectorHalf, ABC):
    """Worker half. Lives with the model runner; moves KV between its cache and elsewhere."""

    #: Whether this half sets ``progress_event`` whenever a transfer may have ended (then an
    #: idle engine sleeps until it does); if not, an idle engine polls every ``POLL_S``.
    signals_progress = False

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_config: KVCacheConfig,
        model_fingerprint: str,
        tp: TPLayout = SINGLE_LAYOUT,
    ) -> None:
        super().__init__(config, kv_cache_config, model_fingerprint, tp)
        self._metadata: KVConnectorMetadata | None = None
        #: Set (by any thread) when a transfer may have ended. Replaced by
        #: ``set_progress_event``: read the attribute each time, never keep the event.
        self.progress_event = threading.Event()

    def set_progress_event(self, event: threading.Event) -> None:
        """Use ``event`` as this half's wake-up (a composite connector shares one among its
        children). Called once, right after construction."""
        self.progress_event = event

    def notify_progress(self) -> None:
        """A transfer may have ended: wake an engine that waits in ``wait_for_progress``."""
        self.progress_event.set()

    def register_kv_caches(self, kv_caches: list[torch.Tensor], layer_groups: list[int]) -> None:
        """The per-layer caches ``[2, num_blocks, block_size, kv_heads, head_size]`` and each
        layer's KV cache group, both by layer index (the model runner's)."""
        self.kv_caches = kv_caches
        self.layer_groups = layer_groups

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def start_load_kv(self) -> None:
        """Before the forward pass: start (or, for synchronous loads, do) this step's loads."""
        return None

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Inside attention, before layer ``layer_idx`` reads its cache."""
        return None

    def save_kv_layer(
        self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata: LayerAttentionMetadata
    ) -> None:
        """Inside attention, right after layer ``layer_idx`` wrote this step's K/V."""
        return None

    def wait_for_save(self) -> None:
        """After the forward pass: block until the cache may be overwritten."""
        return None

    def kv_paths(self) -> dict[str, str]:
        """Peer engine id -> the path KV takes with it now (e.g. "shm", "gloo"), for the
        peers this half moves KV with directly (none by default). Read from any thread."""
        return {}

    def wait_for_progress(self, timeout: float) -> None:
        """Called when a step had nothing to compute and only transfers are pending: block up to
        ``timeout`` seconds (``POLL_S`` unless ``signals_progress``), returning early once
        ``progress_event`` is set."""
        event = self.progress_event
        event.wait(timeout if self.signals_progress else min(timeout, POLL_S))
        event.clear()

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers that reached their terminal state since the last call."""

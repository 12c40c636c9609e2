"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples (``StepSampler``).

Per step, everything is built on the host with numpy from the persistent InputBatch and handed
to torch once: flat token ids and positions, and per KV cache group the block table rows and the
slot mapping. Prefill and decode return the same result type.

Tensor parallel: each rank has a ModelRunner over its shard of the model (``tp``), and every
rank runs every step on the same ``SchedulerOutput``. Only rank 0 samples; a non-first rank is
handed the tokens rank 0 sampled (``accept_sampled_tokens``) before its next step, so that its
batch holds the same tokens and it computes the same rows.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedkv.attention.backends.registry import get_attention_backend
from pagedkv.attention.forward_context import ForwardContext
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.distributed.tp_group import SINGLE_RANK, TPGroup
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.kv_connector.base import KVConnectorWorker
from pagedkv.model.config import ModelConfig
from pagedkv.model.cpu_argmax import load_cpu_argmax
from pagedkv.model.cpu_kernel_setup import attach_cpu_kernels
from pagedkv.model.generation_config import GenerationDefaults
from pagedkv.model.loader import load_model
from pagedkv.utils import cdiv
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.cpu_binding import bind_cpu_cores
from pagedkv.worker.host_memory import keep_freed_host_memory
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.model_runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from pagedkv.worker.resolve import resolve_device, resolve_dtype, resolve_max_model_len
from pagedkv.worker.scheduler_output import GrammarBitmask, SchedulerOutput
from pagedkv.worker.step_sampler import StepSampler
from pagedkv.worker.warm_up import warm_up_steps

logger = logging.getLogger(__name__)


class ModelRunner:
    """Rank ``tp.rank``'s runner (``SINGLE_RANK``: the whole model in this process)."""

    def __init__(self, args: WorkerConfig, tp: TPGroup = SINGLE_RANK) -> None:
        self.tp = tp
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()
        #: Before anything is built or timed: the kernels and their timings see our threads.
        self.cpu_cores = bind_cpu_cores(args.cpu_cores, check_neighbours=self.device.type == "cpu")
        model_path = args.model_path
        checkpoint = ModelConfig.from_pretrained(model_path)
        self.max_model_len = resolve_max_model_len(
            args.max_model_len, checkpoint.max_position_embeddings
        )
        self.generation_defaults = GenerationDefaults.from_model_dir(
            model_path, args.generation_config
        )
        backend = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.attn_backend = get_attention_backend(backend)
        self.attn_backend.check_device(self.device)
        if not args.enforce_eager:
            self.attn_backend.load_kernels(self.device)
        self.dtype = resolve_dtype(args.dtype, checkpoint.dtype, self.device)
        self.model = load_model(model_path, self.dtype, self.device, tp)
        compiled_cpu = not args.enforce_eager and self.device.type == "cpu"
        if self.device.type == "cpu" and self.dtype == torch.float32:
            # Rank 0 makes (or reads) the per-machine kernel choices before the other ranks
            # read them: ranks of equal shards then apply the same, from the first start on.
            if not tp.is_first:
                tp.barrier()
            retune = args.retune_kernels and tp.is_first
            attach_cpu_kernels(self.model, compiled_cpu, retune)
            if tp.is_first:
                tp.barrier()
        #: Greedy tokens on CPU (the logits are fp32 in every model dtype).
        self.argmax_kernel = load_cpu_argmax() if compiled_cpu else None
        self.model_config: ModelConfig = self.model.config
        self.max_num_reqs = args.max_num_seqs
        if args.seed is not None:  # unseeded sampling draws from torch's default generator
            torch.manual_seed(args.seed)
        self.gpu_memory_utilization = args.gpu_memory_utilization
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        #: Each layer's name in the KV cache config, by layer index (the one place it is made).
        self.layer_names = [f"layers.{i}" for i in range(self.model_config.num_hidden_layers)]
        #: The worker half of a KV connector (the attention layers call its per-layer hooks).
        self.kv_connector: KVConnectorWorker | None = None
        #: Every path a request can take has run once (``warm_up``).
        self.warmed_up = False

    # ------------------------------------------------------------------ KV cache
    def default_kv_cache_memory(self) -> int | None:
        """On CUDA, what is free once ``1 - gpu_memory_utilization`` of the device is kept
        back (vLLM's meaning: the engine may use that fraction of the whole GPU); None on CPU."""
        if self.device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(free - total * (1 - self.gpu_memory_utilization))
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no memory for the "
                f"KV cache ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free): raise it"
            )
        return budget

    def get_kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """Each layer's spec on this rank (its KV heads)."""
        dtype = str(self.dtype).removeprefix("torch.")
        specs: dict[str, KVCacheSpec] = {}
        layer_specs = self.model_config.kv_cache_layer_specs(self.tp.world_size)
        for name, layer in zip(self.layer_names, layer_specs):
            kw = dict(
                block_size=block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_size,
                dtype=dtype,
            )
            if layer.sliding_window is None:
                specs[name] = FullAttentionSpec(**kw)
            else:
                specs[name] = SlidingWindowSpec(sliding_window=layer.sliding_window, **kw)
        return specs

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """One zeroed ``[2, num_blocks, block_size, kv_heads, head_size]`` tensor per
        ``KVCacheTensor``; layers of different groups at the same position share it."""
        self.kv_cache_config = kv_cache_config
        num_layers = self.model_config.num_hidden_layers
        layer_index = {name: i for i, name in enumerate(self.layer_names)}
        caches: list[torch.Tensor | None] = [None] * num_layers
        layer_specs = self.model_config.kv_cache_layer_specs(self.tp.world_size)
        for tensor in kv_cache_config.kv_cache_tensors:
            first = layer_specs[layer_index[tensor.shared_by[0]]]
            block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
            # Zeroed, not empty: padding slots are masked out, but 0 * NaN would still be NaN.
            cache = torch.zeros(
                (2, kv_cache_config.num_blocks, block_size, first.num_kv_heads, first.head_size),
                dtype=self.dtype,
                device=self.device,
            )
            for name in tensor.shared_by:
                caches[layer_index[name]] = cache
        assert all(c is not None for c in caches)
        self.kv_caches = caches  # type: ignore[assignment]
        self.layer_to_group = [0] * num_layers
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                self.layer_to_group[layer_index[name]] = gid
        group_specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.group_block_sizes = [spec.block_size for spec in group_specs]
        self.group_windows = [getattr(spec, "sliding_window", None) for spec in group_specs]
        self.input_batch = InputBatch(
            self.max_num_reqs,
            self.max_model_len,
            self.group_block_sizes,
            [cdiv(self.max_model_len, bs) for bs in self.group_block_sizes],
        )
        self.step_sampler = StepSampler(
            self.model, self.input_batch, self.device, self.argmax_kernel, self.tp
        )

    # ------------------------------------------------------------------ request state
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in scheduler_output.preempted_req_ids:
            batch.remove_request(req_id)
        for req_id in scheduler_output.finished_req_ids:
            batch.remove_request(req_id)
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            resumed = self.requests.get(new.req_id)
            num_prompt_logprobs_computed = 0
            if resumed is not None:  # back from preemption: keep drawing from the same stream
                generator = resumed.generator
                num_prompt_logprobs_computed = resumed.num_prompt_logprobs_computed
            elif params.seed is not None and self.tp.is_first:  # rank 0 samples
                generator = torch.Generator(self.device).manual_seed(params.seed)
            else:
                generator = None
            state = CachedRequestState(
                req_id=new.req_id,
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=params,
                generator=generator,
                num_prompt_logprobs_computed=num_prompt_logprobs_computed,
            )
            self.requests[new.req_id] = state
            batch.add_request(state, new.token_ids, new.num_computed_tokens, new.block_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            row = batch.req_id_to_index[cached.req_id]
            batch.block_table.append_row(cached.new_block_ids, row)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    def accept_sampled_tokens(self, req_ids: list[str], sampled_token_ids: list[list[int]]) -> None:
        """On a non-first rank, before its next step: the tokens rank 0 sampled in the last one
        (its output's ``req_ids`` and ``sampled_token_ids``), appended to the rows of the
        requests still in the batch, as rank 0 appended them."""
        batch = self.input_batch
        held = [
            (batch.req_id_to_index[req_id], tokens[0])
            for req_id, tokens in zip(req_ids, sampled_token_ids)
            if tokens and req_id in batch.req_id_to_index
        ]
        if held:
            rows, tokens = zip(*held)
            batch.append_tokens(np.array(rows, dtype=np.int64), list(tokens))

    def warm_up(self) -> None:
        """Run every path a request can take once (``warm_up.warm_up_steps``), before any KV
        connector is attached: the first request then pays no first-call costs. Leaves no
        request, no written KV (the null block is zeroed again) and the global generator as
        it was.

        With several ranks, every rank runs it at once (the steps' collectives meet): a
        non-first rank is not handed rank 0's tokens, so its dummies decode token 0 where rank
        0's decode their samples; the rows computed, the sampled rows, and so the collectives,
        are the same, and the garbage KV lands in the null block either way."""
        if self.kv_connector is not None:
            raise RuntimeError("warm_up runs before a KV connector is attached")
        start = time.perf_counter()
        steps = warm_up_steps(
            self.model_config.vocab_size,
            self.max_model_len,
            self.group_block_sizes,
            self.max_num_reqs,
        )
        for step in steps:
            self.execute_model(step)
        for cache in self.kv_caches:
            cache[:, 0].zero_()
        self.warmed_up = True
        logger.info("warm-up: %d steps in %.2f s", len(steps), time.perf_counter() - start)

    # ------------------------------------------------------------------ one step
    def set_kv_connector(self, connector: KVConnectorWorker) -> None:
        """Attach a KV connector's worker half; it gets the caches and per-layer hooks."""
        self.kv_connector = connector
        connector.register_kv_caches(self.kv_caches, self.layer_to_group)

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """One step. ``grammar_bitmask`` constrains the sampling of the rows it names.

        With several ranks every rank is given the same ``scheduler_output`` and
        ``grammar_bitmask`` (whether there is one decides which collectives the step runs);
        only rank 0's output carries tokens, logprobs and prompt logprobs."""
        self._update_states(scheduler_output)
        connector = self.kv_connector
        if connector is None:
            return self._run(scheduler_output, grammar_bitmask)
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv()
        output = self._run(scheduler_output, grammar_bitmask)
        connector.wait_for_save()
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        output.kv_connector_output = connector.get_finished()
        connector.clear_connector_metadata()
        return output

    def _run(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None
    ) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        req_ids = list(scheduler_output.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), np.int64, len(req_ids))
        counts = np.fromiter(scheduler_output.num_scheduled_tokens.values(), np.int64, len(rows))
        num_reqs = len(rows)

        # Flat varlen batch: request i owns tokens [query_start_loc[i], query_start_loc[i+1]).
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        token_req = np.repeat(np.arange(num_reqs), counts)
        token_rows = rows[token_req]
        num_computed = batch.num_computed_tokens[rows]
        positions = num_computed[token_req] + (np.arange(total) - query_start_loc[token_req])
        input_ids = batch.token_ids_cpu[token_rows, positions]
        seq_lens = (num_computed + counts).astype(np.int32)

        metadata = self._attention_metadata(query_start_loc, seq_lens, rows, token_rows, positions)
        ctx = ForwardContext(self.kv_caches, metadata, self.attn_backend, self.kv_connector)
        hidden_states = self.model(
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            ctx,
        )
        sampled_token_ids, logprobs = self.step_sampler.sample(
            hidden_states, rows, seq_lens, query_start_loc, grammar_bitmask
        )
        prompt_logprobs = self.step_sampler.prompt_logprobs(
            rows, num_computed, counts, query_start_loc, hidden_states
        )
        return ModelRunnerOutput(req_ids, sampled_token_ids, logprobs, prompt_logprobs, num_reqs)

    def _attention_metadata(
        self,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        rows: np.ndarray,
        token_rows: np.ndarray,
        positions: np.ndarray,
    ) -> list[AttentionMetadata]:
        """Each layer's metadata: one per KV cache group (its block table and slot mapping),
        shared by the group's layers."""
        metadata_per_group = []
        for gid, block_size in enumerate(self.group_block_sizes):
            table = self.input_batch.block_table[gid]
            max_blocks = cdiv(int(seq_lens.max()), block_size)
            metadata_per_group.append(
                AttentionMetadata.from_numpy(
                    query_start_loc,
                    seq_lens,
                    table.block_table[rows, :max_blocks],
                    table.compute_slot_mapping(token_rows, positions),
                    block_size,
                    self.group_windows[gid],
                    self.device,
                )
            )
        return [metadata_per_group[g] for g in self.layer_to_group]

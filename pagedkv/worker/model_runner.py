"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

Per step, everything is built on the host with numpy from the persistent InputBatch and handed
to torch once: flat token ids and positions, and per KV cache group the block table rows and the
slot mapping. Only requests that reach the end of their known tokens are sampled (a prefill chunk
that stops mid-prompt produces nothing); prefill and decode return the same result type.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedkv.attention.backends.registry import get_attention_backend
from pagedkv.attention.forward_context import ForwardContext
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.kv_cache.kv_cache_config import KVCacheConfig
from pagedkv.kv_cache.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.kv_connector.base import KVConnectorWorker
from pagedkv.model.config import ModelConfig
from pagedkv.model.cpu_argmax import load_cpu_argmax
from pagedkv.model.cpu_kernel_setup import attach_cpu_kernels
from pagedkv.model.generation_config import GenerationDefaults
from pagedkv.model.loader import load_model
from pagedkv.model.sampler import (
    SAMPLING_EPS,
    LogprobsTensors,
    SamplingMetadata,
    compute_prompt_logprobs,
    sample,
)
from pagedkv.utils import cdiv
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.host_memory import keep_freed_host_memory
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.model_runner_output import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    Logprobs,
    ModelRunnerOutput,
)
from pagedkv.worker.resolve import resolve_device, resolve_dtype, resolve_max_model_len
from pagedkv.worker.scheduler_output import GrammarBitmask, SchedulerOutput
from pagedkv.worker.warm_up import warm_up_steps

logger = logging.getLogger(__name__)


def _to_logprobs(tensors: LogprobsTensors) -> list[Logprobs]:
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks
    return [Logprobs(i, v, r) for i, v, r in zip(ids, values, ranks.tolist())]


class ModelRunner:
    def __init__(self, args: WorkerConfig) -> None:
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()
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
        self.model = load_model(model_path, self.dtype, self.device)
        compiled_cpu = not args.enforce_eager and self.device.type == "cpu"
        if self.device.type == "cpu" and self.dtype == torch.float32:
            attach_cpu_kernels(self.model, compiled_cpu, args.retune_kernels)
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
        dtype = str(self.dtype).removeprefix("torch.")
        specs: dict[str, KVCacheSpec] = {}
        for name, layer in zip(self.layer_names, self.model_config.kv_cache_layer_specs()):
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
        layer_specs = self.model_config.kv_cache_layer_specs()
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
            elif params.seed is not None:
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

    def warm_up(self) -> None:
        """Run every path a request can take once (``warm_up.warm_up_steps``), before any KV
        connector is attached: the first request then pays no first-call costs. Leaves no
        request, no written KV (the null block is zeroed again) and the global generator as
        it was."""
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
        """One step. ``grammar_bitmask`` constrains the sampling of the rows it names."""
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

        metadata_per_group = []
        for gid, block_size in enumerate(self.group_block_sizes):
            table = batch.block_table[gid]
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
        ctx = ForwardContext(
            kv_caches=self.kv_caches,
            attn_metadata=[metadata_per_group[g] for g in self.layer_to_group],
            backend=self.attn_backend,
            kv_connector=self.kv_connector,
        )
        hidden_states = self.model(
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            ctx,
        )

        # Sample the requests whose known tokens are now all computed.
        sample_idx = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: list[Logprobs | None] | None = None
        if sample_idx.size:
            sampled_rows = rows[sample_idx]
            last_token = torch.from_numpy(query_start_loc[1:][sample_idx] - 1).to(self.device)
            logits = self.model.compute_logits(hidden_states[last_token])
            states = None
            if grammar_bitmask is None and batch.plain[sampled_rows].all():
                metadata = SamplingMetadata(
                    temperature=torch.zeros(sample_idx.size, device=self.device), all_greedy=True
                )
            else:
                states = [batch.states[r] for r in sampled_rows]
                self._mask_stop_tokens_before_min_tokens(logits, states)
                metadata = self._sampling_metadata(states)
                if grammar_bitmask is not None:
                    self._add_grammar_bitmask(metadata, states, grammar_bitmask)
            out = sample(logits, metadata, self.argmax_kernel)
            tokens = out.sampled_token_ids.tolist()
            batch.append_tokens(sampled_rows, tokens)
            for i, token in zip(sample_idx.tolist(), tokens):
                sampled_token_ids[i] = [token]
            if out.logprobs is not None:
                assert states is not None  # plain rows ask for no logprobs
                logprobs = [None] * num_reqs
                for j, (i, e) in enumerate(zip(sample_idx.tolist(), _to_logprobs(out.logprobs))):
                    k = states[j].sampling_params.logprobs
                    if k is not None:
                        logprobs[i] = Logprobs(e.token_ids[: k + 1], e.logprobs[: k + 1], e.rank)  # type: ignore[index]

        prompt_logprobs = self._prompt_logprobs(
            req_ids, rows, num_computed, counts, query_start_loc, hidden_states
        )
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_reqs=num_reqs,
        )

    # ------------------------------------------------------------------ sampling helpers
    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        device = self.device

        def column(name: str, off: float, dtype=torch.float32) -> torch.Tensor | None:
            values = [getattr(p, name) for p in params]
            if all(v == off for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        all_greedy = all(p.temperature < SAMPLING_EPS for p in params)
        top_k = None if all_greedy else column("top_k", 0, torch.int64)
        if top_k is not None:
            top_k = top_k.clamp(min=0)  # -1 and 0 both mean "off"
            if not bool(top_k.any()):
                top_k = None
        has_penalties = any(p.has_penalties for p in params)
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=top_k,
            top_p=None if all_greedy else column("top_p", 1.0),
            min_p=None if all_greedy else column("min_p", 0.0),
            repetition_penalties=column("repetition_penalty", 1.0),
            presence_penalties=column("presence_penalty", 0.0),
            frequency_penalties=column("frequency_penalty", 0.0),
            prompt_token_ids=[self._token_ids(s)[0] for s in states] if has_penalties else None,
            output_token_ids=[self._token_ids(s)[1] for s in states] if has_penalties else None,
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            all_greedy=all_greedy,
        )

    def _add_grammar_bitmask(
        self,
        metadata: SamplingMetadata,
        states: list[CachedRequestState],
        grammar_bitmask: GrammarBitmask,
    ) -> None:
        """The engine's packed bitmask, unpacked on the host into the sampled rows' mask."""
        sampled_row = {state.req_id: i for i, state in enumerate(states)}
        rows = [sampled_row.get(req_id, -1) for req_id in grammar_bitmask.req_ids]
        vocab_size = self.model_config.vocab_size
        mask = np.ones((len(states), vocab_size), dtype=bool)
        present = [i for i, row in enumerate(rows) if row >= 0]
        mask[[rows[i] for i in present]] = grammar_bitmask.allowed(vocab_size)[present]
        metadata.allowed_token_mask = torch.from_numpy(mask).to(self.device)

    def _token_ids(self, state: CachedRequestState) -> tuple[np.ndarray, np.ndarray]:
        """The request's prompt and output tokens so far (views of its row)."""
        batch = self.input_batch
        row = batch.req_id_to_index[state.req_id]
        return batch.token_ids_cpu[row, : state.num_prompt_tokens], batch.output_token_ids(row)

    def _mask_stop_tokens_before_min_tokens(
        self, logits: torch.Tensor, states: list[CachedRequestState]
    ) -> None:
        """Until a request has ``min_tokens`` outputs, none of its stop ids (every EOS id
        included, even under ``ignore_eos``) can be sampled, so the stop check after sampling
        needs no min_tokens case."""
        for i, state in enumerate(states):
            params = state.sampling_params
            if params.all_stop_token_ids and len(self._token_ids(state)[1]) < params.min_tokens:
                logits[i, list(params.all_stop_token_ids)] = float("-inf")

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        num_computed: np.ndarray,
        counts: np.ndarray,
        query_start_loc: np.ndarray,
        hidden_states: torch.Tensor,
    ) -> dict[str, list[Logprobs]]:
        """Logprob of prompt token ``p + 1`` for each prompt position ``p`` computed this step,
        unless computed before (a preempted request computes its prompt again)."""
        out: dict[str, list[Logprobs]] = {}
        batch = self.input_batch
        if batch.plain[rows].all():  # plain requests ask for no prompt logprobs
            return out
        for i, req_id in enumerate(req_ids):
            state = batch.states[rows[i]]
            k = state.sampling_params.prompt_logprobs
            computed = int(num_computed[i])
            start = max(computed, state.num_prompt_logprobs_computed)
            end = min(computed + int(counts[i]), state.num_prompt_tokens - 1)
            if k is None or start >= end:
                continue
            state.num_prompt_logprobs_computed = end
            first = int(query_start_loc[i]) + start - computed
            logits = self.model.compute_logits(hidden_states[first : first + end - start])
            targets = torch.from_numpy(batch.token_ids_cpu[rows[i], start + 1 : end + 1])
            out[req_id] = _to_logprobs(compute_prompt_logprobs(logits, targets.to(self.device), k))
        return out

"""StepSampler: a step's tokens and logprobs from the model's hidden states.

Only requests that reach the end of their known tokens are sampled (a prefill chunk that stops
mid-prompt produces nothing). A step whose sampled rows are all ``plain`` takes one argmax with
no per-row work; otherwise each row's parameters, min_tokens, penalties and the engine's grammar
bitmask are read from the persistent ``InputBatch``.

Tensor parallel: every rank runs ``sample`` on the same rows (each rank's batch holds the same
tokens: a non-first rank is handed rank 0's) and takes part in the same collectives: an all-plain
step gathers each rank's greedy candidates (``greedy_across_ranks``), any other step the rows'
logits (``gather_logits``). Only rank 0 samples, appends and returns tokens; the others return
no tokens, and no logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.distributed.tp_group import SINGLE_RANK, TPGroup
from pagedkv.model.cpu_argmax import CpuArgmax
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.parallel_logits import gather_logits, greedy_across_ranks
from pagedkv.model.sampler import (
    SAMPLING_EPS,
    LogprobsTensors,
    SamplerOutput,
    SamplingMetadata,
    compute_prompt_logprobs,
    sample,
)
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.model_runner_output import Logprobs
from pagedkv.worker.scheduler_output import GrammarBitmask


def _to_logprobs(tensors: LogprobsTensors) -> list[Logprobs]:
    ids, values, ranks = tensors.token_ids.tolist(), tensors.logprobs.tolist(), tensors.ranks
    return [Logprobs(i, v, r) for i, v, r in zip(ids, values, ranks.tolist())]


@dataclass(slots=True)
class StepSampler:
    """Samples the step's rows of ``batch`` from ``model``'s hidden states, on ``device``;
    ``argmax_kernel``: the compiled CPU argmax for greedy rows (None: torch ops); ``tp``: the
    tensor-parallel group ``model`` is a shard of."""

    model: LlamaForCausalLM
    batch: InputBatch
    device: torch.device
    argmax_kernel: CpuArgmax | None
    tp: TPGroup = SINGLE_RANK

    def sample(
        self,
        hidden_states: torch.Tensor,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        query_start_loc: np.ndarray,
        grammar_bitmask: GrammarBitmask | None,
    ) -> tuple[list[list[int]], list[Logprobs | None] | None]:
        """Sample the requests (batch ``rows``, in step order) whose known tokens are now all
        computed, appending each token to its row: ``(sampled token ids, logprobs)`` per request,
        an empty list for a request not sampled; logprobs None when no request asked."""
        batch = self.batch
        sample_idx = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        sampled_token_ids: list[list[int]] = [[] for _ in range(len(rows))]
        if not sample_idx.size:
            return sampled_token_ids, None
        sampled_rows = rows[sample_idx]
        last_token = torch.from_numpy(query_start_loc[1:][sample_idx] - 1).to(self.device)
        logits = self.model.compute_logits(hidden_states[last_token])
        plain = grammar_bitmask is None and bool(batch.plain[sampled_rows].all())
        states = None
        if plain and self.tp.world_size > 1:
            greedy = greedy_across_ranks(
                logits, self.model.shards.vocab, self.tp, self.argmax_kernel
            )
            out = None if greedy is None else SamplerOutput(greedy, None)
        else:
            whole = gather_logits(logits, self.model.config.vocab_size, self.tp)
            out = None
            if whole is not None:
                out, states = self._sample_rows(whole, sampled_rows, plain, grammar_bitmask)
        if out is None:  # not rank 0, which samples
            return sampled_token_ids, None
        tokens = out.sampled_token_ids.tolist()
        batch.append_tokens(sampled_rows, tokens)
        for i, token in zip(sample_idx.tolist(), tokens):
            sampled_token_ids[i] = [token]
        if out.logprobs is None:
            return sampled_token_ids, None
        assert states is not None  # plain rows ask for no logprobs
        logprobs: list[Logprobs | None] = [None] * len(rows)
        for j, (i, e) in enumerate(zip(sample_idx.tolist(), _to_logprobs(out.logprobs))):
            k = states[j].sampling_params.logprobs
            if k is not None:
                logprobs[i] = Logprobs(e.token_ids[: k + 1], e.logprobs[: k + 1], e.rank)  # type: ignore[index]
        return sampled_token_ids, logprobs

    def _sample_rows(
        self,
        logits: torch.Tensor,
        sampled_rows: np.ndarray,
        plain: bool,
        grammar_bitmask: GrammarBitmask | None,
    ) -> tuple[SamplerOutput, list[CachedRequestState] | None]:
        """Sample the whole vocabulary's ``logits`` of ``sampled_rows``: one argmax when the rows
        are ``plain``; else with each row's states (returned), min_tokens and grammar masks."""
        if plain:
            metadata = SamplingMetadata(
                temperature=torch.zeros(len(sampled_rows), device=self.device), all_greedy=True
            )
            return sample(logits, metadata, self.argmax_kernel), None
        states = [self.batch.states[r] for r in sampled_rows]
        self._mask_stop_tokens_before_min_tokens(logits, states)
        metadata = self._sampling_metadata(states)
        if grammar_bitmask is not None:
            metadata.allowed_token_mask = self._grammar_mask(states, grammar_bitmask)
        return sample(logits, metadata, self.argmax_kernel), states

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

    def _grammar_mask(
        self, states: list[CachedRequestState], grammar_bitmask: GrammarBitmask
    ) -> torch.Tensor:
        """The engine's packed bitmask, unpacked on the host into the sampled rows' mask."""
        sampled_row = {state.req_id: i for i, state in enumerate(states)}
        rows = [sampled_row.get(req_id, -1) for req_id in grammar_bitmask.req_ids]
        vocab_size = self.model.config.vocab_size
        mask = np.ones((len(states), vocab_size), dtype=bool)
        present = [i for i, row in enumerate(rows) if row >= 0]
        mask[[rows[i] for i in present]] = grammar_bitmask.allowed(vocab_size)[present]
        return torch.from_numpy(mask).to(self.device)

    def _token_ids(self, state: CachedRequestState) -> tuple[np.ndarray, np.ndarray]:
        """The request's prompt and output tokens so far (views of its row)."""
        batch = self.batch
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

    def prompt_logprobs(
        self,
        rows: np.ndarray,
        num_computed: np.ndarray,
        counts: np.ndarray,
        query_start_loc: np.ndarray,
        hidden_states: torch.Tensor,
    ) -> dict[str, list[Logprobs]]:
        """Logprob of prompt token ``p + 1`` for each prompt position ``p`` computed this step,
        unless computed before (a preempted request computes its prompt again)."""
        out: dict[str, list[Logprobs]] = {}
        batch = self.batch
        if batch.plain[rows].all():  # plain requests ask for no prompt logprobs
            return out
        for i, row in enumerate(rows):
            state = batch.states[row]
            k = state.sampling_params.prompt_logprobs
            computed = int(num_computed[i])
            start = max(computed, state.num_prompt_logprobs_computed)
            end = min(computed + int(counts[i]), state.num_prompt_tokens - 1)
            if k is None or start >= end:
                continue
            state.num_prompt_logprobs_computed = end
            first = int(query_start_loc[i]) + start - computed
            logits = gather_logits(
                self.model.compute_logits(hidden_states[first : first + end - start]),
                self.model.config.vocab_size,
                self.tp,
            )
            if logits is None:  # not rank 0, which returns them
                continue
            next_ids = batch.token_ids_cpu[row, start + 1 : end + 1]
            targets = torch.from_numpy(next_ids).to(self.device)
            out[state.req_id] = _to_logprobs(compute_prompt_logprobs(logits, targets, k))
        return out

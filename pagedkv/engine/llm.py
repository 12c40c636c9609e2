"""LLM: the offline API, ``LLM(model).generate(prompts, SamplingParams(...))`` and
``LLM(model).chat(messages, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

from tqdm import tqdm

from pagedkv.engine.chat_template import render_chat
from pagedkv.engine.engine_args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request_input import PromptType, RequestInput
from pagedkv.sampling_params import RequestOutputKind, SamplingParams


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids, or a dict) or a list of them."""
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


class LLM:
    """Offline batched generation. Keyword arguments are EngineArgs fields (vLLM's names)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation config over vLLM's defaults (``generation_config="vllm"``:
        vLLM's alone); ``generate`` and ``chat`` use it when given no SamplingParams."""
        return self.llm_engine.default_sampling_params()

    def chat(
        self,
        messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages)
        or to several (a list of such lists), rendered by the tokenizer's chat template."""
        conversations = messages
        if messages and isinstance(messages[0], Mapping):
            conversations = [messages]  # type: ignore[list-item]
        tokenizer = self.get_tokenizer()
        prompts = [render_chat(tokenizer, c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order (each with
        ``sampling_params.n`` completions)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts"
                )
        # vLLM's LLM.generate asks for final outputs only: no per-step outputs to build.
        final_only = {
            id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            for p in params_list
        }
        params_list = [final_only[id(p)] for p in params_list]
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
                request = RequestInput(prompt, params, priority=priority[i] if priority else 0)
                ids.append(engine.add_request(request))
        except ValueError:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        # No bar at all unless asked: a disabled tqdm still makes a process lock and a monitor
        # thread on first use (1.5 ms of the first call).
        progress = tqdm(total=len(ids), desc="Processed prompts") if use_tqdm else nullcontext()
        with progress as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        return [finished[i] for i in ids]

"""pagedkv: a readable LLM inference engine with vLLM-V1-style paged KV cache management and
prefill/decode disaggregation.

    from pagedkv import LLM, SamplingParams
    outputs = LLM().generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64))
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    # Lazy, so that `import pagedkv.kv_cache` stays free of torch and the engine.
    if name == "LLM":
        from pagedkv.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedkv.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from pagedkv.engine.engine_args import EngineArgs

        return EngineArgs
    if name == "SamplingParams":
        from pagedkv.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from pagedkv.engine.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")

"""pagedkv: a readable LLM inference engine with vLLM-V1-style paged KV cache management and
prefill/decode disaggregation.

    from pagedkv import LLM, SamplingParams
    outputs = LLM().generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64))
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: The public API by module, imported on first use: ``import pagedkv.kv_cache`` stays free of
#: torch and the engine.
_EXPORTS = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.llm_engine",
    "AsyncLLM": "pagedkv.engine.async_llm",
    "EngineArgs": "pagedkv.engine.engine_args",
    "SamplingParams": "pagedkv.sampling_params",
    "RequestInput": "pagedkv.engine.request_input",
    "RequestOutput": "pagedkv.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""One start of the built-in model in this process, for ``test_kernel_choices``: prints one JSON
line with the kernel choices the engine applied (keyed as in the choices file) and the
logprobs of a greedy request (prompt and output, top 5 each).

    python -m tests.engine.kernel_choices_start [ENGINE_ARGS_JSON]
"""

from __future__ import annotations

import json
import logging
import sys

from pagedkv import LLM, SamplingParams
from pagedkv.model.linear import Linear
from pagedkv.model.lm_head import LMHead


def applied_choices(model) -> dict[str, bool]:
    """What the modules do, under the choices file's keys."""
    applied = {}
    for m in model.modules():
        if isinstance(m, Linear):
            rows, cols = m.weight.shape
            bias = "" if m.bias is None else " + bias"
            key = f"oneDNN over MKL: {type(m).__name__} {rows}x{cols}{bias}"
            applied[key] = m.weight_packed is not None
        if isinstance(m, LMHead):
            applied[f"LM head batches by vocab over by hidden: {rows}x{cols}"] = m.batches_by_vocab
            applied[f"LM head one row by vocab over by hidden: {rows}x{cols}"] = m.gemv_by_vocab
    return applied


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    llm = LLM(None, device="cpu", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, prompt_logprobs=5)
    prompts = [list(range(3, 40)), [7, 8, 9]]  # a batch, then one request alone
    outputs = llm.generate(prompts, params, use_tqdm=False)

    def values(entries) -> list:
        return [
            None if e is None else sorted((t, v.logprob) for t, v in e.items()) for e in entries
        ]

    print(
        json.dumps(
            {
                "applied": applied_choices(llm.llm_engine.model_runner.model),
                "prompt_logprobs": [values(o.prompt_logprobs) for o in outputs],
                "logprobs": [values(o.outputs[0].logprobs) for o in outputs],
                "token_ids": [o.outputs[0].token_ids for o in outputs],
            }
        )
    )


if __name__ == "__main__":
    main()

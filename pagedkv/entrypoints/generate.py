"""``pagedkv generate``: run prompts batched, stream each completion to the terminal in order."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from pagedkv.arg_types import unescaped
from pagedkv.engine.engine_args import EngineArgs
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request_input import RequestInput
from pagedkv.sampling_params import SamplingParams


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="text to complete")
    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per prompt (default: the generation config's max_new_tokens, else 128)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the model's generation config, see --generation-config, "
        "else 1); with --seed (default 0) sampling is reproducible",
    )
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: model's)")
    g.add_argument("--top-k", type=int, default=None, help="0 = no top-k (default: model's)")
    g.add_argument(
        "--stop",
        action="append",
        type=unescaped,
        default=[],
        metavar="TEXT",
        help=r'stop string (repeatable; escapes such as "\n" are read as in JSON)',
    )
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    EngineArgs.add_cli_args(parser)


class OrderedStreamPrinter:
    """Prints prompt 1 and its completion live, then prompt 2, ...

    All prompts generate at once: a later completion that is ahead is buffered (outputs are
    cumulative, so only its latest text is kept) and flushed when its turn comes.
    """

    def __init__(self, prompts: list[str], request_ids: list[str], out: TextIO) -> None:
        self.prompts = prompts
        self.request_ids = request_ids
        self.out = out
        self.latest: dict[str, RequestOutput] = {}
        self.current = 0
        self.num_printed_chars = 0
        self._bold = out.isatty()
        self._print_prompt()

    def update(self, output: RequestOutput) -> None:
        self.latest[output.request_id] = output
        while self.current < len(self.request_ids):
            output = self.latest.get(self.request_ids[self.current])
            if output is None:
                return
            text = output.outputs[0].text
            self.out.write(text[self.num_printed_chars :])
            self.num_printed_chars = len(text)
            if not output.finished:
                self.out.flush()
                return
            self.out.write("\n")
            self.current += 1
            self.num_printed_chars = 0
            if self.current < len(self.prompts):
                self.out.write("\n")
                self._print_prompt()

    def _print_prompt(self) -> None:
        prompt = self.prompts[self.current]
        self.out.write(f"\033[1m{prompt}\033[0m" if self._bold else prompt)
        self.out.flush()


def run_generate(args: argparse.Namespace) -> None:
    """Raises ValueError (the command prints it on one line) for bad flags or input."""
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.model.generation_config import GenerationDefaults

    engine_args = EngineArgs.from_cli_args(args)
    defaults = GenerationDefaults.from_model_dir(
        engine_args.model_path, engine_args.generation_config
    ).sampling
    given = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_tokens": args.max_tokens,
    }
    params = SamplingParams(
        **({"max_tokens": 128} | defaults | {k: v for k, v in given.items() if v is not None}),
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(engine_args)
    request_ids = [engine.add_request(RequestInput(prompt, params)) for prompt in args.prompts]
    printer = OrderedStreamPrinter(args.prompts, request_ids, sys.stdout)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            printer.update(output)
    elapsed = time.perf_counter() - start
    outputs = printer.latest.values()
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"{len(request_ids)} prompt(s): {num_prompt_tokens} prompt tokens, "
        f"{num_generated} generated tokens in {elapsed:.2f} s "
        f"({num_generated / elapsed:.1f} tok/s)",
        file=sys.stderr,
    )

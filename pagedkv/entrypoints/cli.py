"""The ``pagedkv`` command: generate | serve | proxy | bench {throughput, serve}.

Heavy imports (torch, transformers, the engine, the server) happen inside the command that
needs them, so ``--help`` is instant. A bad flag or input ends the command with one line on
stderr (``pagedkv serve: error: ...``), as argparse's own errors do; Ctrl-C ends it quietly.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH, model_arg
from pagedkv.executor.errors import RankDiedError

_SUMMARIES = {
    "generate": "Complete prompts in one batch, streaming each completion to the terminal.",
    "serve": "Serve a model over the OpenAI HTTP API (/v1/completions, /v1/chat/completions).",
    "proxy": "Front P and D instances (prefill/decode disaggregation) with one OpenAI HTTP API.",
    "bench": "Benchmarks: offline throughput, or load against a running server.",
    "throughput": "Offline throughput of LLM.generate: requests/s, input and output tokens/s.",
    "bench-serve": "Streaming load against a running server: TTFT, ITL, E2E percentiles, "
    "throughput.",
}

_EXAMPLES = {
    "generate": """examples:
  pagedkv generate "def fibonacci(n):"
  pagedkv generate "import os" "class Stack:" --max-tokens 64 --temperature 0.8 --seed 1
  pagedkv generate "def add(a, b):" --temperature 0 --stop "\\n\\n"

--seed seeds each prompt's sampling, so a run is reproducible.""",
    "serve": """examples:
  pagedkv serve                                   # the built-in model on 127.0.0.1:8000
  pagedkv serve --port 8001 --api-key secret --max-num-seqs 64 --generation-config vllm
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'""",
    "proxy": """examples:
  pagedkv proxy --port 10001 --registry-port 30001 --routing least_loaded
  pagedkv serve --port 8100 --kv-transfer-config '{"kv_connector":"P2pConnector",
      "kv_role":"kv_producer","kv_port":14579,"kv_connector_extra_config":
      {"proxy_ip":"127.0.0.1","proxy_port":30001}}'                            # a P
  pagedkv serve --port 8200 --kv-transfer-config '{"kv_connector":"P2pConnector",
      "kv_role":"kv_consumer","kv_port":14580,"kv_connector_extra_config":
      {"proxy_ip":"127.0.0.1","proxy_port":30001}}'                            # a D
  curl localhost:10001/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "def add(a, b):", "max_tokens": 32, "temperature": 0}'

Registrations are HMAC-checked when $PAGEDKV_KV_SECRET is set (set it on every instance too).""",
    "throughput": """examples:
  pagedkv bench throughput --num-prompts 64 --input-len 128 --output-len 128
  pagedkv bench throughput --dataset shared-prefix --prefix-len 96 --input-len 16 \\
      --output-len 64 --num-prompts 32 --json out.json
  pagedkv bench throughput --num-prompts 64 --compare-unconstrained \\
      --json-schema '{"type": "array", "items": {"type": "integer"}, "maxItems": 40}'""",
    "bench-serve": """examples:
  pagedkv bench serve --num-prompts 200 --request-rate 8 --result-json r.json --plot r.png
  pagedkv bench serve --dataset shared-prefix --prefix-len 96 --input-len 32 \\
      --output-len 64 --num-prompts 64 --max-concurrency 16""",
}


def _check_model(args: argparse.Namespace) -> None:
    model = model_arg(args)
    path = Path(model) if model else DEFAULT_MODEL_PATH
    if not (path / "config.json").is_file():
        hint = " (the built-in model is not installed)" if not model else ""
        raise ValueError(f"no model at {path}{hint}: pass a Hugging Face model directory")
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ValueError(f"--tokenizer {tokenizer}: no such directory")


def _check_port_free(host: str, port: int) -> None:
    """Before loading the model: is the port taken? (uvicorn would say so only after.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as e:
            reason = "in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise ValueError(f"cannot listen on {host}:{port}: {reason}") from None


def _generate(args: argparse.Namespace) -> None:
    from pagedkv.entrypoints.generate import run_generate

    _check_model(args)
    run_generate(args)


def _serve(args: argparse.Namespace) -> None:
    _check_model(args)
    _check_port_free(args.host, args.port)
    from pagedkv.entrypoints.openai.api_server import run_server

    run_server(args)


def _proxy(args: argparse.Namespace) -> None:
    from pagedkv.entrypoints.proxy.app import run_proxy

    run_proxy(args)


def _bench_throughput(args: argparse.Namespace) -> None:
    from pagedkv.entrypoints.bench.throughput import run_throughput

    _check_model(args)
    run_throughput(args)


def _bench_serve(args: argparse.Namespace) -> None:
    from pagedkv.entrypoints.bench.serve import run_bench_serve

    run_bench_serve(args)


class _CommandParser(argparse.ArgumentParser):
    """A command's parser (``pagedkv serve``, ``pagedkv bench``, ...). An argument it does not
    know is its own error, printed under its own usage: argparse would hand the argument up
    to ``pagedkv``'s parser, whose usage (``pagedkv [-h] COMMAND ...``) names no command."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _add_command(
    subparsers,
    name: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    func: Callable[[argparse.Namespace], None],
    key: str | None = None,
) -> None:
    """Adds command ``name``, its summary and examples those of ``key`` (default: ``name``)."""
    key = key or name
    parser = subparsers.add_parser(
        name,
        help=_SUMMARIES[key],
        description=_SUMMARIES[key],
        epilog=_EXAMPLES[key],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_args(parser)
    parser.set_defaults(func=func, command=parser.prog.removeprefix("pagedkv "))


def make_parser() -> argparse.ArgumentParser:
    # The argument definitions are light (no torch): import them eagerly.
    from pagedkv.entrypoints import generate
    from pagedkv.entrypoints.bench import serve_args as bench_serve
    from pagedkv.entrypoints.bench import throughput
    from pagedkv.entrypoints.openai import cli_args as serve_args
    from pagedkv.entrypoints.proxy import cli_args as proxy_args

    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="pagedkv: a paged-KV-cache LLM inference engine (vLLM V1 style).",
    )
    commands = parser.add_subparsers(
        title="commands", metavar="COMMAND", required=True, parser_class=_CommandParser
    )
    _add_command(commands, "generate", generate.add_cli_args, _generate)
    _add_command(commands, "serve", serve_args.add_cli_args, _serve)
    _add_command(commands, "proxy", proxy_args.add_cli_args, _proxy)
    summary = _SUMMARIES["bench"]
    bench = commands.add_parser("bench", help=summary, description=summary)
    benches = bench.add_subparsers(
        title="benchmarks", metavar="BENCHMARK", required=True, parser_class=_CommandParser
    )
    _add_command(benches, "throughput", throughput.add_cli_args, _bench_throughput)
    _add_command(benches, "serve", bench_serve.add_cli_args, _bench_serve, key="bench-serve")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except (ValueError, ImportError, RankDiedError) as e:  # flags the engine refuses, a
        sys.exit(f"pagedkv {args.command}: error: {e}")  # missing extra, a rank that failed

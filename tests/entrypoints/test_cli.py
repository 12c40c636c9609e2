"""The ``pagedkv`` command: help, ``generate`` end to end, and both benchmarks."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagedkv.entrypoints.cli import main, make_parser
from tests.entrypoints.conftest import (
    API_KEY,
    MODEL_NAME,
    REPO_ROOT,
    Server,
    free_port,
    pagedkv_command,
    run_pagedkv,
    subprocess_env,
)

COMMANDS = [
    [],
    ["generate"],
    ["serve"],
    ["proxy"],
    ["bench"],
    ["bench", "throughput"],
    ["bench", "serve"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "pagedkv")
def test_help(command: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: pagedkv")
    if command in (["generate"], ["serve"], ["bench", "throughput"]):
        assert "engine:" in text and "--max-num-seqs" in text and "examples:" in text


def test_serve_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_API_KEY", "from-env")
    args = make_parser().parse_args(["serve", "some/model", "--max-num-seqs", "8"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, "from-env")
    assert args.model == "some/model" and args.max_num_seqs == 8


def test_proxy_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDKV_PROXY_API_KEY", raising=False)
    args = make_parser().parse_args(["proxy", "--max-attempts", "5"])
    assert (args.host, args.port, args.registry_port) == ("127.0.0.1", 10001, 30001)
    assert args.routing == "round_robin" and args.api_key is None
    assert (args.instance_timeout, args.connect_timeout, args.request_timeout) == (6, 5, 600)
    assert args.max_attempts == 5


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-attempts", "0"),  # every request would be a 503 without trying any pair
        ("--max-attempts", "-1"),
        ("--instance-timeout", "0"),  # every instance would be dropped right after registering
        ("--connect-timeout", "-5"),
        ("--request-timeout", "0"),
        ("--request-timeout", "nan"),
    ],
)
def test_proxy_rejects_counts_and_times_not_above_zero(
    flag: str, value: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args(["proxy", f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err


def test_serve_registers_with_a_list_of_proxies() -> None:
    args = make_parser().parse_args(
        ["serve", "m", "--registry", "127.0.0.1:30001, proxy-b.local:30002,[::1]:30003"]
    )
    assert args.registry == [("127.0.0.1", 30001), ("proxy-b.local", 30002), ("[::1]", 30003)]


@pytest.mark.parametrize(
    "value, why",
    [
        ("127.0.0.1:30001,bad", "'bad': not HOST:PORT"),
        ("127.0.0.1:30001,", "'': not HOST:PORT"),
        ("127.0.0.1:0", "port must be an integer in 1..65535"),
        ("127.0.0.1:99999", "port must be an integer in 1..65535"),
        ("a b:30001", "host must be an IP address or a host name"),
        ("h:1,h:1", "'h:1' is listed twice"),
    ],
)
def test_serve_rejects_a_bad_registry_list(
    value: str, why: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args(["serve", "m", f"--registry={value}"])
    assert exit_info.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert "argument --registry: must be HOST:PORT[,HOST:PORT...]: " in line and why in line


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no model at"):
        main(["generate", "--model", str(tmp_path), "hello"])


def test_generate_streams_completions_in_prompt_order(tiny_model: Path, server: Server) -> None:
    prompts = ["w5 w17 w42 w99", "w9 w10", "w200"]
    # Different lengths: later prompts finish first and must wait for their turn.
    result = run_pagedkv(
        "generate", "--model", str(tiny_model), *prompts, "--max-tokens", "6", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr
    client = server.client()
    expected = [
        prompt
        + client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
        .choices[0]
        .text
        for prompt in prompts
    ]
    assert result.stdout == "\n\n".join(expected) + "\n"
    assert "3 prompt(s): 7 prompt tokens, 18 generated tokens" in result.stderr
    assert "tok/s" in result.stderr


def test_generate_rejects_bad_input(tiny_model: Path) -> None:
    result = run_pagedkv("generate", "--model", str(tiny_model), "w1", "--temperature", "-1")
    assert result.returncode != 0 and "temperature must be >= 0" in result.stderr


def test_bench_serve_writes_json_and_plot(server: Server, tmp_path: Path) -> None:
    result_json, plot = tmp_path / "result.json", tmp_path / "plot.png"
    result = run_pagedkv(
        "bench", "serve",
        "--base-url", server.base_url,
        "--api-key", API_KEY,
        "--dataset", "shared-prefix",
        "--num-prompts", "12",
        "--prefix-len", "32",
        "--input-len", "8",
        "--output-len", "6",
        "--request-rate", "50",
        "--max-concurrency", "8",
        "--result-json", str(result_json),
        "--plot", str(plot),
        "--disable-tqdm",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Serving Benchmark Result" in result.stdout and "P99 TTFT (ms)" in result.stdout
    report = json.loads(result_json.read_text())
    summary = report["summary"]
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 12 * 40
    assert summary["total_cached_tokens"] > 0  # the shared 32-token prefix is two full blocks
    assert summary["total_output_tokens"] == 12 * 6
    assert set(summary["ttft"]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}
    requests = report["requests"]
    assert sorted(r["index"] for r in requests) == list(range(12))
    assert len({r["request_id"] for r in requests}) == 12
    assert all(r["ok"] for r in requests)
    # Tokens a slow client has not read yet reach it in one chunk (as in vLLM), so on a loaded
    # machine a request may see no gap between chunks; not all twelve.
    assert any(len(r["itl"]) >= 1 for r in requests)
    assert report["config"]["model"] == MODEL_NAME
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_bench_serve_for_a_duration_checks_each_answer_and_the_metrics(
    server: Server, tmp_path: Path
) -> None:
    """The load driver on a single instance: 4 clients back to back for 3 s; every request
    answered exactly once, each with a fresh prompt (once the 8 prompts were reused in turn and
    nearly every request was a prefix-cache hit); afterwards no request runs and no KV block is
    in use."""
    result_json = tmp_path / "load.json"
    result = run_pagedkv(
        "bench", "serve",
        "--base-url", server.base_url,
        "--api-key", API_KEY,
        "--input-len", "40",
        "--output-len", "8",
        "--num-prompts", "8",
        "--seed", "4242",  # prompts no other test on this server sent
        "--duration", "3",
        "--max-concurrency", "4",
        "--check-metrics", server.base_url,
        "--result-json", str(result_json),
        "--disable-tqdm",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{server.base_url}: at rest" in result.stdout
    report = json.loads(result_json.read_text())
    summary, requests = report["summary"], report["requests"]
    assert summary["failed"] == 0 and summary["completed"] == len(requests) > 8
    assert summary["total_cached_tokens"] == 0  # 40 fresh tokens each: no block is a hit
    assert sorted(r["index"] for r in requests) == list(range(len(requests)))
    assert summary["instances"] == {server.base_url: True}
    assert "p99_ms" in summary["ttft"] and "p99_ms" in summary["itl"]


def test_an_instance_that_does_not_answer_is_not_at_rest(server: Server) -> None:
    from pagedkv.entrypoints.bench.settle import wait_settled

    dead = f"http://127.0.0.1:{free_port()}"
    ok, gone = wait_settled([server.base_url, dead], timeout_s=0.3)
    assert ok.settled and ok.gauges["pagedkv:kv_cache_usage_perc"] == 0
    assert not gone.settled and "ConnectError" in gone.describe()


def test_bench_serve_counts_failures(server: Server) -> None:
    result = run_pagedkv(
        "bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY,
        "--model", "no-such-model", "--num-prompts", "2", "--input-len", "4",
        "--output-len", "2", "--disable-tqdm",
    )  # fmt: skip
    assert result.returncode == 1
    assert "Failed requests:" in result.stdout and "HTTP 404" in result.stdout


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-concurrency", "0"),  # once: httpx.Limits(max_connections=0), every request hung
        ("--max-concurrency", "-2"),
        ("--duration", "0"),
        ("--duration", "nan"),
        ("--num-prompts", "0"),
        ("--request-rate", "0"),
        ("--request-rate", "-1"),
        ("--input-len", "0"),
        ("--output-len", "-1"),
        ("--timeout", "0"),
    ],
)
def test_bench_serve_rejects_numbers_below_one(
    flag: str, value: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args(["bench", "serve", f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err


def test_bench_serve_load_needs_a_positive_concurrency() -> None:
    from pagedkv.entrypoints.bench.serve import run_load

    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        asyncio.run(run_load("http://127.0.0.1:1", MODEL_NAME, [], max_concurrency=0))


def test_request_sampler_draws_request_i_the_same_whatever_came_before() -> None:
    from pagedkv.entrypoints.bench.datasets import RequestSampler
    from pagedkv.entrypoints.bench.serve import run_load

    sampler = RequestSampler("random", 12, 3, vocab_size=100, seed=7)
    again = RequestSampler("random", 12, 3, vocab_size=100, seed=7)
    assert again[5] == sampler[5] and sampler[5] != sampler[4]
    assert len({tuple(sampler[i].prompt_token_ids) for i in range(200)}) == 200
    assert sampler.first(3) == [sampler[0], sampler[1], sampler[2]]
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        sampler.first(0)
    shared = RequestSampler("shared-prefix", 5, 3, vocab_size=100, seed=7, prefix_len=8)
    first, later = shared[0].prompt_token_ids, shared[1000].prompt_token_ids
    assert len(first) == 13 and first[:8] == later[:8] and first[8:] != later[8:]
    excluded = RequestSampler("random", 50, 1, vocab_size=4, seed=1, exclude_token_ids={0, 2})
    assert set(excluded[3].prompt_token_ids) == {1, 3}
    with pytest.raises(ValueError, match="seed must be >= 0"):
        RequestSampler("random", 4, 1, vocab_size=9, seed=-1)
    with pytest.raises(ValueError, match="dataset must be one of"):
        RequestSampler("x", 4, 1, vocab_size=9, seed=0)
    with pytest.raises(ValueError, match="need a duration"):
        asyncio.run(run_load("http://127.0.0.1:1", MODEL_NAME, sampler, max_concurrency=1))


@pytest.mark.parametrize(
    "event, error",
    [
        (b'{"error": "engine gone"}', "stream error: engine gone"),  # once: AttributeError
        (b'{"error": {"message": "bad"}}', "stream error: bad"),
        (b"5", "TypeError"),
        (b'{"id": "bench-x", "choices": null}', "TypeError"),
    ],
)
def test_bench_serve_counts_a_malformed_stream_as_a_failed_request(
    event: bytes, error: str
) -> None:
    from pagedkv.entrypoints.bench.datasets import BenchRequest
    from pagedkv.entrypoints.bench.serve import send_request

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: " + event + b"\n\ndata: [DONE]\n\n")

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            request = BenchRequest([1, 2], 2)
            return await send_request(client, "http://x", MODEL_NAME, request, 0, "bench-x", 0.0)

    result = asyncio.run(run())
    assert not result.ok and error in result.error


def test_bench_throughput(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    result = run_pagedkv(
        "bench", "throughput", "--model", str(tiny_model),
        "--num-prompts", "8", "--input-len", "24", "--output-len", "8",
        "--json", str(out), "--disable-tqdm",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "requests/s" in result.stdout and "output tok/s" in result.stdout
    figures = json.loads(out.read_text())
    assert figures["num_requests"] == 8 and figures["total_output_tokens"] == 64
    assert figures["total_input_tokens"] == 8 * 24
    assert figures["output_tokens_per_second"] > 0
    assert figures["first_run_output_tokens_per_second"] > 0  # the warm-up run, apart


def test_bench_throughput_with_a_json_schema_against_unconstrained(tmp_path: Path) -> None:
    """Structured outputs in the batch: the compile time per schema, the same prompts without
    the schema at the same output lengths, and the ratio."""
    out = tmp_path / "schema.json"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    result = run_pagedkv(
        "bench", "throughput", "--num-prompts", "6", "--input-len", "16", "--output-len", "32",
        "--json-schema", json.dumps(schema), "--compare-unconstrained", "--num-pairs", "1",
        "--json", str(out),
        "--disable-tqdm",
        timeout=300,  # six runs of the workload: slow on a loaded machine
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "ms per schema" in result.stdout and "Constrained / unconstrained" in result.stdout
    figures = json.loads(out.read_text())
    assert figures["grammar_compile_ms_per_schema"] > 0
    unconstrained = figures["unconstrained"]
    assert unconstrained["total_output_tokens"] == figures["total_output_tokens"]
    assert figures["constrained_over_unconstrained"] > 0
    assert len(figures["constrained_over_unconstrained_pairs"]) == 2


def test_help_imports_neither_torch_nor_transformers() -> None:
    """``pagedkv --help`` took 3.5 s importing transformers to build the parser."""
    code = (
        "import sys; from pagedkv.entrypoints.cli import make_parser; make_parser(); "
        "print(sorted({'torch', 'transformers', 'numpy', 'httpx'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env()
    )
    assert result.stdout.strip() == "[]", result.stderr


# (flags, the error's text, whether to run it as a real process): the rest run ``main`` in this
# process, which prints what the interpreter would (an import of torch and a model load less).
FLAG_ERRORS = [
    (["--block-size", "0"], "argument --block-size: must be an integer >= 1, got '0'", True),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer >= 1", False),
    (["--max-model-len", "0"], "argument --max-model-len: must be an integer >= 1", False),
    (["--max-model-len", "300"], "max_model_len 300 is larger than the model's", True),
    (["--kv-cache-memory", "1KiB"], "the KV cache budget gives 0 blocks", False),
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a size", False),
    (["--device", "cuda"], "device 'cuda' was asked for", False),
    # a real process: tests/attention turn on the Triton interpreter in this one
    (["--attention-backend", "triton"], "the triton attention kernels need CUDA tensors", True),
    (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: no such directory", False),
    (["--generation-config", "/nonexistent"], "generation_config must be 'auto', 'vllm'", False),
]


def run_main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """``pagedkv ARGV`` in this process: its exit status and standard error, as the interpreter
    reports a ``SystemExit`` (a message is printed, status 1)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    code, err = exit_info.value.code, capsys.readouterr().err
    if isinstance(code, str):
        return 1, f"{err}{code}\n"
    return code or 0, err


@pytest.mark.parametrize("flags, error, real_process", FLAG_ERRORS)
def test_engine_flag_errors_are_one_line(
    tiny_model: Path, flags: list[str], error: str, real_process: bool, capsys
) -> None:
    argv = ["generate", "--model", str(tiny_model), "w1", *flags]
    if real_process:
        result = run_pagedkv(*argv)
        returncode, stderr = result.returncode, result.stderr
    else:
        returncode, stderr = run_main(argv, capsys)
    assert returncode != 0 and "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if "error:" in line]
    assert line.startswith("pagedkv generate: error: ") and error in line, stderr


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_serve_port_must_be_a_port(port: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args(["serve", "--port", port])
    assert exit_info.value.code == 2
    assert "argument --port: must be a port number in [0, 65535]" in capsys.readouterr().err


#: Each command, its required arguments given, with ``{}`` where the unknown one goes.
VALID_BUT_FOR = {
    "generate": ["generate", "w1", "{}"],
    "serve": ["serve", "{}"],
    "proxy": ["proxy", "{}"],
    "bench": ["bench", "{}", "throughput"],
    "bench throughput": ["bench", "throughput", "{}"],
    "bench serve": ["bench", "serve", "{}"],
}


@pytest.mark.parametrize("command", list(VALID_BUT_FOR))
@pytest.mark.parametrize("bad", ["--bogus", "--max-tokenz=5"])
def test_an_unknown_argument_shows_the_commands_usage(command: str, bad: str) -> None:
    """argparse hands a command's unknown arguments up to ``pagedkv``'s parser, which printed
    its own usage (``pagedkv [-h] COMMAND ...``) instead of the command's."""
    result = run_pagedkv(*[a.format(bad) for a in VALID_BUT_FOR[command]], timeout=60)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"usage: pagedkv {command} [-h]"), result.stderr
    assert lines[-1] == f"pagedkv {command}: error: unrecognized arguments: {bad}", result.stderr


def test_serve_on_a_busy_port_fails_before_loading_the_model(tiny_model: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_pagedkv("serve", str(tiny_model), "--port", str(port), timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"pagedkv serve: error: cannot listen on 127.0.0.1:{port}: in use" in result.stderr
    assert "pagedkv engine" not in result.stderr  # the model was never loaded


def test_serve_takes_the_model_as_a_flag_too() -> None:
    from pagedkv.engine.engine_args import EngineArgs

    args = make_parser().parse_args(["serve", "--model", "some/dir"])
    assert EngineArgs.from_cli_args(args).model == "some/dir"
    both = make_parser().parse_args(["serve", "a", "--model", "b"])
    with pytest.raises(ValueError, match="the model is given twice"):
        EngineArgs.from_cli_args(both)


def test_stop_reads_escapes_as_json_does() -> None:
    args = make_parser().parse_args(["generate", "x", "--stop", "\\n\\n", "--stop", "a\\tb"])
    assert args.stop == ["\n\n", "a\tb"]


def test_ctrl_c_ends_generate_without_a_traceback(tiny_model: Path) -> None:
    # A suite started in the background of a script ignores SIGINT, and an ignored signal stays
    # ignored across exec (the child then ran to the end and exited 0): handled here, it is back
    # to its default in the child, which Python turns into KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        process = subprocess.Popen(
            pagedkv_command(
                "generate",
                "--model",
                str(tiny_model),
                "w1",
                "w2",
                "w3",
                "w4",
                "--max-tokens",
                "250",
                "--ignore-eos",
                "--max-num-seqs",
                "1",
            ),
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert process.stdout is not None
    # The first prompt is printed: the command is past its imports and in its step loop, which
    # runs the four prompts one after another (1000 steps), so the signal lands in it.
    process.stdout.read(2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr

"""A real ``pagedkv serve`` subprocess on a tiny model, driven over HTTP by the tests."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.ports import free_port
from tests.tiny_models import CONFIGS, build_checkpoint, build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
MODEL_NAME = "tiny-llama"
SERVER_START_TIMEOUT = 120.0
#: Roles as words of the tiny word-level vocabulary, so a rendered chat tokenizes exactly.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w1 {% elif m['role'] == 'user' %}w2 {% else %}w3 {% endif %}"
    "{{ m['content'] }} w4 "
    "{% endfor %}"
    "{% if add_generation_prompt %}w3{% endif %}"
)


def pagedkv_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv", *args]


def subprocess_env() -> dict[str, str]:
    """This checkout first on the path (pagedkv may be installed from another one); without
    the Triton interpreter that tests/attention turns on for this process (a server runs the
    production path: Triton on CUDA tensors only)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_pagedkv(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        pagedkv_command(*args),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the word-level tokenizer and a chat template."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    config = CONFIGS["llama"]()
    build_checkpoint(directory, config)
    build_tokenizer(directory, config.vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0)

    def post(self, path: str, **kwargs) -> httpx.Response:
        kwargs["headers"] = {"Authorization": f"Bearer {API_KEY}"} | kwargs.get("headers", {})
        kwargs.setdefault("timeout", 60)
        return httpx.post(f"{self.base_url}{path}", **kwargs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics by name; labels other than model_name join the name:
        ``pagedkv:request_success_total{finished_reason=abort}``."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                key = sample.name
                if labels:
                    key += "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                samples[key] = sample.value
        return samples

    def wait_for_metrics(self, condition, timeout: float = 15.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if condition(metrics) or time.monotonic() > deadline:
                return metrics
            time.sleep(0.05)

    def assert_alive(self) -> None:
        """The server still answers a plain request."""
        out = self.client().completions.create(
            model=MODEL_NAME, prompt="w1 w2", max_tokens=2, temperature=0
        )
        assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve(tmp_path_factory, str(tiny_model), "--max-num-seqs", "64")


@pytest.fixture(scope="session")
def builtin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The built-in model (a byte-level BPE that can spell any JSON), named by ``--model``."""
    from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH

    yield from serve(tmp_path_factory, "--model", str(DEFAULT_MODEL_PATH), "--max-num-seqs", "32")


def serve(tmp_path_factory: pytest.TempPathFactory, *args: str) -> Iterator[Server]:
    """A ``pagedkv serve`` subprocess on a free port, until the session ends."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = log_path.open("w")
    process = subprocess.Popen(
        pagedkv_command(
            "serve",
            *args,
            "--port",
            str(port),
            "--api-key",
            API_KEY,
            "--served-model-name",
            MODEL_NAME,
        ),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    handle = Server(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"server not healthy in {SERVER_START_TIMEOUT} s:\n{log_path.read_text()}"
                )
            try:
                if httpx.get(f"{handle.base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield handle
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def idle_connection_survives(base_url: str, idle_s: float) -> bool:
    """Whether an HTTP/1.1 connection to ``base_url`` still answers after ``idle_s`` of
    silence (``http.client``: one connection, no client-side pool expiry of its own; each
    answer is read whole, so the second request never reads the rest of the first)."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.connect()
    conn.auto_open = 0  # a closed connection raises NotConnected instead of reconnecting
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        time.sleep(idle_s)
        try:
            conn.request("GET", "/health")
            second = conn.getresponse()
            second.read()
            return second.status == 200
        except (OSError, http.client.HTTPException):
            return False
    finally:
        conn.close()

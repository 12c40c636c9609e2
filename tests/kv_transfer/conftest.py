"""Process fixtures for KV-transfer tests: engines (and, over HTTP, servers and the proxy) in
their own processes on loopback, each reaped at teardown whatever the test did."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.engine.conftest import checkpoint  # noqa: F401  (the session's tiny models)
from tests.entrypoints.conftest import (  # noqa: F401  (tiny_model: a session fixture)
    API_KEY,
    MODEL_NAME,
    REPO_ROOT,
    Server,
    free_port,
    pagedkv_command,
    subprocess_env,
    tiny_model,
)
from tests.kv_transfer.engine_host import EngineHost


def _engine_starter(checkpoint, log_dir: Path, hosts: list[EngineHost]):  # noqa: F811
    def start(name: str, arch: str = "llama", hook: str | None = None, **engine_args):
        host = EngineHost(checkpoint(arch), log_dir, name, hook=hook, **engine_args)
        hosts.append(host)
        return host

    return start


@pytest.fixture
def start_engine(checkpoint, tmp_path) -> Iterator:  # noqa: F811
    """``start_engine(name, arch="llama", hook=None, **engine_args)`` -> an EngineHost (booting
    in the background: start P and D, then use them), closed after the test."""
    hosts: list[EngineHost] = []
    yield _engine_starter(checkpoint, tmp_path, hosts)
    for host in hosts:
        host.close()


@pytest.fixture(scope="module")
def start_module_engine(checkpoint, tmp_path_factory) -> Iterator:  # noqa: F811
    """Like ``start_engine``, for engines the tests of a module share."""
    hosts: list[EngineHost] = []
    yield _engine_starter(checkpoint, tmp_path_factory.mktemp("engines"), hosts)
    for host in hosts:
        host.close()


@pytest.fixture(scope="session")
def reference_outputs(checkpoint):  # noqa: F811
    """``reference_outputs(arch, prompts, max_tokens)``: a single instance's greedy tokens."""
    from pagedkv import LLM, SamplingParams

    engines: dict[str, LLM] = {}

    def run(arch: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        if arch not in engines:
            engines[arch] = LLM(str(checkpoint(arch)), max_num_seqs=16)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = engines[arch].generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    return run


# ---------------------------------------------------------------------------- over HTTP
SECRET = "test-kv-secret"
MAX_TOKENS = 8


def complete(client, prompt: list[int], stream: bool) -> str:
    kwargs = dict(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    chunks = client.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def total(servers, names, metric: str) -> float:
    return sum(servers[n].metrics().get(metric, 0.0) for n in names)


def wait_all_blocks_free(servers) -> None:
    for name, server in servers.items():
        metrics = server.wait_for_metrics(lambda m: m["pagedkv:kv_cache_usage_perc"] == 0)
        assert metrics["pagedkv:kv_cache_usage_perc"] == 0, f"{name} still holds blocks"


def wait_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"{url} exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"{url} not healthy in {timeout_s}s:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def reap(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


@dataclass
class Proxy:
    base_url: str
    registry_port: int
    process: subprocess.Popen
    log_path: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0)

    def instances(self) -> dict:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.get(f"{self.base_url}/instances", headers=headers, timeout=10).json()

    def wait_for_instances(
        self, num_prefill: int, num_decode: int, timeout_s: float = 30, num_replicas: int = 0
    ) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            live = self.instances()
            counts = (len(live["prefill"]), len(live["decode"]), len(live["replica"]))
            if counts == (num_prefill, num_decode, num_replicas):
                return live
            if time.monotonic() > deadline:
                pytest.fail(
                    f"proxy sees {live}, expected {num_prefill}P{num_decode}D {num_replicas}R"
                )
            time.sleep(0.1)


class Cluster:
    """Processes of one test (module): ``pagedkv proxy`` and ``pagedkv serve`` instances."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model = model
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen] = []
        self._logs = []

    def _spawn(self, name: str, args: list[str], env: dict | None = None):
        log_path = self.log_dir / f"{name}.log"
        log = log_path.open("w")
        self._logs.append(log)
        process = subprocess.Popen(
            pagedkv_command(*args),
            cwd=REPO_ROOT,
            env={**subprocess_env(), **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.processes.append(process)
        return process, log_path

    def proxy(
        self,
        *extra: str,
        instance_timeout: float = 3.0,
        name: str = "proxy",
        port: int | None = None,
        registry_port: int | None = None,
    ) -> Proxy:
        """Start ``pagedkv proxy`` and wait until it answers (on the given ports, or free ones:
        a proxy restarted on its ports gets its instances back)."""
        port, registry_port = port or free_port(), registry_port or free_port()
        process, log_path = self._spawn(
            name,
            [
                "proxy",
                "--port", str(port),
                "--registry-port", str(registry_port),
                "--api-key", API_KEY,
                "--upstream-api-key", API_KEY,
                "--instance-timeout", str(instance_timeout),
                "--request-timeout", "60",
                *extra,
            ],
            env={"PAGEDKV_KV_SECRET": SECRET},
        )  # fmt: skip
        proxy = Proxy(f"http://127.0.0.1:{port}", registry_port, process, log_path)
        wait_healthy(proxy.base_url, process, log_path, 60)
        return proxy

    def serve(
        self, name: str, role: str, proxy: Proxy | None = None, *cli_args: str, **extra
    ) -> tuple[Server, dict]:
        """Start ``pagedkv serve`` with the P2P connector (not waiting: call ``ready``);
        ``cli_args`` go on its command line, ``extra`` into its kv_transfer_config."""
        top = {k: extra.pop(k) for k in list(extra) if k.startswith("kv_")}
        config = {
            "kv_connector": "P2pConnector",
            "kv_role": role,
            "kv_port": free_port(),
            "engine_id": name,
            "kv_connector_extra_config": {
                "heartbeat_s": 0.5,
                "proxy_heartbeat_s": 0.5,
                **({"proxy_ip": "127.0.0.1", "proxy_port": proxy.registry_port} if proxy else {}),
                **extra,
            },
            **top,
        }
        return self.serve_config(name, config, *cli_args), config

    def serve_config(self, name: str, kv_transfer_config: dict, *cli_args: str) -> Server:
        """Start ``pagedkv serve`` with any kv_transfer_config (not waiting: call ``ready``)."""
        return self.serve_plain(
            name, "--kv-transfer-config", json.dumps(kv_transfer_config), *cli_args
        )

    def serve_plain(self, name: str, *cli_args: str, port: int | None = None) -> Server:
        """Start ``pagedkv serve`` (not waiting: call ``ready``) on ``port`` or a free one."""
        port = port or free_port()
        process, log_path = self._spawn(
            name,
            [
                "serve", str(self.model),
                "--port", str(port),
                "--api-key", API_KEY,
                "--served-model-name", MODEL_NAME,
                *cli_args,
            ],
            env={"PAGEDKV_KV_SECRET": SECRET},
        )  # fmt: skip
        return Server(f"http://127.0.0.1:{port}", process, log_path)

    def ready(self, *servers: Server) -> None:
        """Wait until each is healthy; they start together, so each takes longer to start
        the more there are (on 2 cores a model server needs ~10 s of CPU to start)."""
        timeout_s = 60 + 30 * len(servers)
        for server in servers:
            wait_healthy(server.base_url, server.process, server.log_path, timeout_s)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            reap(process)
        for log in self._logs:
            log.close()


@pytest.fixture(scope="module")
def cluster_factory(tiny_model, tmp_path_factory) -> Iterator:  # noqa: F811
    """``cluster_factory()`` -> a Cluster whose processes all die with the module."""
    clusters: list[Cluster] = []

    def make() -> Cluster:
        cluster = Cluster(tiny_model, tmp_path_factory.mktemp("cluster"))
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


@pytest.fixture(scope="session")
def reference_text(tiny_model):  # noqa: F811
    """``reference_text(prompts, max_tokens)``: a single instance's greedy completions."""
    from pagedkv import LLM, SamplingParams

    llm = LLM(str(tiny_model), max_num_seqs=16)

    def run(prompts: list[list[int]], max_tokens: int) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    return run

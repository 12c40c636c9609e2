"""What ``pagedkv proxy`` answers besides completions, and what its 503 says, with real
``pagedkv serve`` processes and the real ``openai`` client: ``/v1/models`` and
``/v1/models/{id}`` from any registered instance (plain replicas, P, D), ``/version``,
``pagedkv bench serve`` through a proxy over replicas (the README's load test), unknown request
fields named in the server's log, and a 503 that names every instance it did not use and why.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from pagedkv.entrypoints.proxy.registry import Instance
from pagedkv.entrypoints.proxy.router import Router
from pagedkv.entrypoints.serving.registration import Register
from pagedkv.transport.peer_addr import PeerAddr
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, run_pagedkv

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def replicas(cluster_factory):
    """A proxy over two plain replicas (``pagedkv serve --registry``)."""
    cluster = cluster_factory()
    proxy = cluster.proxy()
    registry = ("--registry", f"127.0.0.1:{proxy.registry_port}")
    servers = {name: cluster.serve_plain(name, *registry) for name in ("R0", "R1")}
    cluster.ready(*servers.values())
    proxy.wait_for_instances(0, 0, num_replicas=len(servers))
    return SimpleNamespace(proxy=proxy, servers=servers)


@pytest.fixture(scope="module")
def mismatched_pd(cluster_factory):
    """A proxy over an fp32 P, an fp32 D and a bf16 D (which pairs with no P). Instances stay
    registered for 60 s without a heartbeat: a killed one is still routed to (and fails)."""
    cluster = cluster_factory()
    proxy = cluster.proxy(instance_timeout=60.0)
    servers = {
        "P-fp32": cluster.serve("P-fp32", "kv_producer", proxy)[0],
        "D-fp32": cluster.serve("D-fp32", "kv_consumer", proxy)[0],
        "D-bf16": cluster.serve("D-bf16", "kv_consumer", proxy, "--dtype", "bfloat16")[0],
    }
    cluster.ready(*servers.values())
    proxy.wait_for_instances(1, 2)
    return SimpleNamespace(proxy=proxy, servers=servers)


def assert_models_listed_and_retrieved(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "no-such-model" in error["message"] and MODEL_NAME in error["message"]


def test_the_server_retrieves_its_model_and_404s_another(replicas) -> None:
    assert_models_listed_and_retrieved(replicas.servers["R0"].client())


def test_models_through_a_proxy_over_plain_replicas(replicas) -> None:
    """Once ``/v1/models`` asked decode instances only: over replicas it was a 503."""
    assert_models_listed_and_retrieved(replicas.proxy.client())
    version = httpx.get(f"{replicas.proxy.base_url}/version", timeout=10)
    server_version = httpx.get(f"{replicas.servers['R0'].base_url}/version", timeout=10)
    assert version.status_code == 200 and version.json() == server_version.json()


def test_bench_serve_through_a_proxy_over_replicas(replicas, tmp_path: Path) -> None:
    """The README's load test: it reads the model from the proxy's ``/v1/models`` first."""
    result_json = tmp_path / "load.json"
    urls = [s.base_url for s in replicas.servers.values()]
    result = run_pagedkv(
        "bench", "serve",
        "--base-url", replicas.proxy.base_url,
        "--api-key", API_KEY,
        "--num-prompts", "6",
        "--input-len", "8",
        "--output-len", "4",
        "--max-concurrency", "3",
        "--check-metrics", *urls,
        "--result-json", str(result_json),
        "--disable-tqdm",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result_json.read_text())["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["instances"] == {url: True for url in urls}


def ignored_warnings(log_path: Path, field: str) -> list[str]:
    lines = log_path.read_text().splitlines()
    return [line for line in lines if line.startswith("WARNING") and field in line]


def wait_for_warning(log_path: Path, field: str, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not (warnings := ignored_warnings(log_path, field)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return warnings


@pytest.mark.parametrize(
    ("replica", "path", "body", "named"),
    [
        ("R0", "/v1/completions", {"prompt": "w1 w2", "max_token": 3}, "'max_token'"),
        (
            "R1",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "w5", "nme": "a"}], "max_tokens": 2},
            "'messages[0].nme'",
        ),
    ],
)
def test_unknown_request_fields_are_answered_and_named_in_one_warning(
    replicas, replica, path, body, named
) -> None:
    server = replicas.servers[replica]
    assert ignored_warnings(server.log_path, named) == []
    r = httpx.post(f"{server.base_url}{path}", json={"model": MODEL_NAME, **body}, headers=AUTH)
    assert r.status_code == 200, r.text
    (warning,) = wait_for_warning(server.log_path, named)
    assert "were present in the request but ignored" in warning
    assert "max_tokens" not in warning and "'model'" not in warning


def test_models_through_a_proxy_over_p_and_d(mismatched_pd) -> None:
    assert_models_listed_and_retrieved(mismatched_pd.proxy.client())
    out = mismatched_pd.proxy.client().completions.create(
        model=MODEL_NAME, prompt="w1 w2 w3", max_tokens=2, temperature=0
    )
    assert out.choices[0].finish_reason == "length"


def test_the_503_names_each_instance_not_used_and_why(mismatched_pd) -> None:
    """D-fp32 is killed: the attempt on it fails. Once the 503 listed only that attempt, not
    why D-bf16 (another dtype than the only P) and P-fp32 (no D left to pair with) were not
    used."""
    servers = mismatched_pd.servers
    servers["D-fp32"].process.send_signal(signal.SIGKILL)
    servers["D-fp32"].process.wait(timeout=30)
    body = {"model": MODEL_NAME, "prompt": "w1 w2", "max_tokens": 2}
    r = httpx.post(f"{mismatched_pd.proxy.base_url}/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError"
    message = error["message"]
    assert "every attempt failed (D-fp32" in message
    (_, unused) = message.split("not used: ")
    by_name = dict(entry.split(": ", 1) for entry in unused.split(" | "))
    assert by_name.keys() == {
        f"D-bf16 ({servers['D-bf16'].base_url})",
        f"P-fp32 ({servers['P-fp32'].base_url})",
    }
    why_d = by_name[f"D-bf16 ({servers['D-bf16'].base_url})"]
    assert why_d.startswith("no prefill instance has its model and KV layout")
    assert "bfloat16" in why_d and "float32" in why_d
    why_p = by_name[f"P-fp32 ({servers['P-fp32'].base_url})"]
    assert why_p.startswith("no decode instance has its model and KV layout")


# ---------------------------------------------------------------------------- the router alone
class FakeRegistry:
    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances

    def live(self) -> list[Instance]:
        return list(self.instances)


def instance(name: str, role: str, fingerprint: str) -> Instance:
    info = Register(role, f"http://{name}.local:8000", "m", fingerprint, kv_layout=fingerprint)
    return Instance(PeerAddr(name, "127.0.0.1", 1), info, time.monotonic())


def test_why_no_pair_names_each_instance_not_used_and_why() -> None:
    """p0 failed this request: d0 (its layout) is left with no P, d1 never had one."""
    router = Router(
        FakeRegistry(  # type: ignore[arg-type]
            [
                instance("p0", "kv_producer", "fp32"),
                instance("d0", "kv_consumer", "fp32"),
                instance("d1", "kv_consumer", "bf16"),
            ]
        )
    )
    assert router.route(exclude={"p0"}) is None
    why = router.why_no_pair(exclude={"p0"})
    counts, unused = why.split("; not used: ")
    assert counts == "1 prefill, 2 decode and 0 replica instances are registered"
    d0, d1 = unused.split(" | ")
    assert d0 == (
        "d0 (http://d0.local:8000): each prefill instance it pairs with failed this request (p0)"
    )
    assert d1.startswith(
        "d1 (http://d1.local:8000): no prefill instance has its model and KV layout"
    )

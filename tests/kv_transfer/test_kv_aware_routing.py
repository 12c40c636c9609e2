"""KV-aware routing over HTTP: ``pagedkv proxy --routing kv_aware`` in front of three plain
``pagedkv serve`` replicas that publish their KV events and register with ``--registry``.

The proxy's prediction of each request's prefix hit (``x-pagedkv-predicted-hit-tokens``) must
equal what the replica that answered measured (``usage.prompt_tokens_details.cached_tokens``),
before and after a replica restarts and after the proxy itself restarts (its index rebuilt
from snapshots); no request is lost meanwhile."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME
from tests.kv_transfer.conftest import wait_healthy
from tests.load_check import short_load
from tests.ports import free_port

NUM_REPLICAS = 3
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def events_config() -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        }
    )


@pytest.fixture(scope="module")
def replicas(cluster_factory, tiny_model):
    cluster = cluster_factory()
    proxy_args = ("--routing", "kv_aware", "--tokenizer", str(tiny_model))
    proxy = cluster.proxy(*proxy_args, instance_timeout=6.0)
    commands, servers = {}, {}
    for i in range(NUM_REPLICAS):
        name = f"R{i}"
        commands[name] = (
            "--registry", f"127.0.0.1:{proxy.registry_port}",
            "--kv-events-config", events_config(),
            "--max-num-seqs", "16",
        )  # fmt: skip
        servers[name] = cluster.serve_plain(name, *commands[name])
    cluster.ready(*servers.values())
    proxy.wait_for_instances(0, 0, num_replicas=NUM_REPLICAS)
    return SimpleNamespace(
        cluster=cluster, proxy=proxy, proxy_args=proxy_args, servers=servers, commands=commands
    )


def shared_prefix_workload(seed: int, num_prefixes: int = 4, num_users: int = 3) -> list[dict]:
    """Request bodies: ``num_prefixes`` system prompts (40-70 words) × ``num_users`` questions,
    shuffled; completions and chats, streamed (with usage) or not."""
    rng = random.Random(seed)
    bodies = []
    for p in range(num_prefixes):
        system = " ".join(f"w{rng.randrange(5, 250)}" for _ in range(rng.randrange(40, 70)))
        for u in range(num_users):
            question = " ".join(f"w{rng.randrange(5, 250)}" for _ in range(rng.randrange(3, 20)))
            body: dict = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
            if p % 2:
                body["messages"] = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ]
            else:
                body["prompt"] = f"{system} {question}"
            if u % 2:
                body["stream"] = True
                body["stream_options"] = {"include_usage": True}
            bodies.append(body)
    rng.shuffle(bodies)
    return bodies


def send(proxy_url: str, body: dict) -> tuple[str, int, int]:
    """(replica, predicted hit tokens, measured hit tokens) of one request through the proxy."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with httpx.stream("POST", proxy_url + path, json=body, headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
        headers = response.headers
    if body.get("stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: {")]
        usage = [json.loads(e)["usage"] for e in events if json.loads(e).get("usage")][-1]
    else:
        usage = json.loads(text)["usage"]
    return (
        headers["x-pagedkv-instance"],
        int(headers["x-pagedkv-predicted-hit-tokens"]),
        usage["prompt_tokens_details"]["cached_tokens"],
    )


def assert_predictions_exact(proxy_url: str, seed: int) -> list[tuple[str, int, int]]:
    """One request at a time (each request's events are in before the next is routed)."""
    answers = [send(proxy_url, body) for body in shared_prefix_workload(seed)]
    assert [predicted for _, predicted, _ in answers] == [hit for _, _, hit in answers], answers
    return answers


def test_predicted_overlap_equals_each_replicas_measured_prefix_hit(replicas) -> None:
    answers = assert_predictions_exact(replicas.proxy.base_url, seed=1)
    assert sum(hit for _, _, hit in answers) > 0, "the workload shares prefixes: some must hit"
    # The caches start empty and requests come one at a time: the first three system prompts
    # go to the three replicas, each new one where the least work went lately.
    first_at: dict[str, str] = {}
    for body, (replica, _, _) in zip(shared_prefix_workload(seed=1), answers, strict=True):
        system = body["prompt"] if "prompt" in body else body["messages"][0]["content"]
        first_at.setdefault(system[:40], replica)
    assert len(set(list(first_at.values())[:3])) == 3, first_at
    metrics = httpx.get(f"{replicas.proxy.base_url}/metrics", timeout=10).text
    assert f"pagedkv:proxy_exact_hit_predictions_total {float(len(answers))}" in metrics
    live = replicas.proxy.instances()["replica"]
    assert all(i["kv_index"]["synced"] and i["kv_index"]["state"] == "live" for i in live)
    assert sum(i["kv_index"]["cached_blocks"] for i in live) > 0
    # No offloading tier: the pool is the only medium, in /instances and /metrics alike.
    for i in live:
        by_medium = i["kv_index"]["cached_blocks_by_medium"]
        assert by_medium == {"GPU": i["kv_index"]["cached_blocks"]}
        gauge = f'pagedkv:proxy_kv_index_cached_blocks{{instance="{i["engine_id"]}",medium="GPU"}}'
        assert gauge in metrics


def test_a_replica_restarted_under_load_loses_no_request_and_routing_recovers(replicas) -> None:
    """SIGTERM drains R1 (its requests finish, the proxy stops sending it new ones) while 4
    clients run; it comes back as a new process on the same ports (seq from 0, an empty
    cache): the index follows it from a fresh snapshot and predictions are exact again."""
    name = "R1"
    server = replicas.servers[name]
    survivors = [s.base_url for n, s in replicas.servers.items() if n != name]

    def restart() -> None:
        time.sleep(1.0)
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=30)
        port = int(server.base_url.rsplit(":", 1)[1])
        replicas.servers[name] = replicas.cluster.serve_plain(
            f"{name}-restarted", *replicas.commands[name], port=port
        )

    restarter = threading.Thread(target=restart)
    restarter.start()
    short_load([replicas.proxy.base_url], survivors, seconds=6, clients=4, dataset="shared-prefix")
    restarter.join()
    restarted = replicas.servers[name]
    wait_healthy(restarted.base_url, restarted.process, restarted.log_path, 120)
    replicas.proxy.wait_for_instances(0, 0, num_replicas=NUM_REPLICAS, timeout_s=30)
    assert_predictions_exact(replicas.proxy.base_url, seed=2)


def test_a_restarted_proxy_rebuilds_its_index_from_snapshots(replicas) -> None:
    """The proxy's events are all lost when it restarts: it reloads each replica's cache from
    a snapshot, so a prefix cached before the restart is predicted (and hit) after it."""
    proxy = replicas.proxy
    warm = shared_prefix_workload(seed=3, num_prefixes=2, num_users=1)
    for body in warm:
        send(proxy.base_url, body)
    proxy.process.send_signal(signal.SIGTERM)
    proxy.process.wait(timeout=30)
    port = int(proxy.base_url.rsplit(":", 1)[1])
    replicas.proxy = proxy = replicas.cluster.proxy(
        *replicas.proxy_args,
        instance_timeout=6.0,
        name="proxy-restarted",
        port=port,
        registry_port=proxy.registry_port,
    )
    live = proxy.wait_for_instances(0, 0, num_replicas=NUM_REPLICAS)
    deadline = time.monotonic() + 20
    while not all(i["kv_index"].get("synced") for i in live["replica"]):
        assert time.monotonic() < deadline, live
        time.sleep(0.2)
        live = proxy.instances()
    for body in warm:  # the same requests again: cached before the proxy restarted
        _, predicted, hit = send(proxy.base_url, body)
        assert predicted == hit > 0

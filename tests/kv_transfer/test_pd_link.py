"""1P1D across a real, slow link: P (with the proxy beside it) in one network namespace, D in
another, joined by a veth pair shaped to 10 Mbit/s each way with ``tc tbf``
(``tests/netns_link.py``). Every process is a real ``pagedkv`` command run by ``ip netns exec``;
the test talks to them from inside P's namespace with the real ``openai`` client.

The KV must cross the link (the pair is told ``same_host_transport: network``: P and D share
a host and a boot, but the link is what is under test): greedy outputs through PD equal a
single instance's, D computes only each prompt's last token, P's end of the link sends at
least the bytes the connector reports, and the transfers take at least as long as those bytes
need at the link's rate (a lower bound only: nothing here asserts how fast anything is).

Needs root and iproute2; skips elsewhere with the reason, except where
``PAGEDKV_REQUIRE_NETNS=1`` (CI), where it fails."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.kv_transfer.conftest import (
    API_KEY,
    MAX_TOKENS,
    MODEL_NAME,
    REPO_ROOT,
    SECRET,
    Proxy,
    Server,
    complete,
    pagedkv_command,
    reap,
    subprocess_env,
    wait_all_blocks_free,
    wait_healthy,
)
from tests.netns_link import NetnsLink, require_link, tbf_burst_bytes
from tests.tiny_models import random_prompt

RATE_BIT = 10_000_000
#: Every port is free in namespaces made for this test alone.
PROXY_PORT, REGISTRY_PORT, HTTP_PORT, KV_PORT = 8000, 30001, 8100, 14579
BYTES_SENT = "pagedkv:kv_transfer_num_bytes_sent_total"
BYTES_RECEIVED = "pagedkv:kv_transfer_num_bytes_received_total"


class LinkedProcesses:
    """``pagedkv`` commands each inside one side of ``link``, logging to ``log_dir``; all
    ended on ``close``."""

    def __init__(self, link: NetnsLink, model: Path, log_dir: Path) -> None:
        self.link, self.model, self.log_dir = link, model, log_dir
        self.processes: list[subprocess.Popen] = []

    def spawn(self, side: str, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(
                self.link.command(side, pagedkv_command(*args)),
                cwd=REPO_ROOT,
                env={**subprocess_env(), "PAGEDKV_KV_SECRET": SECRET},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.processes.append(process)
        return process, log_path

    def proxy(self) -> Proxy:
        host = self.link.address("p")
        process, log_path = self.spawn(
            "p", "proxy", "proxy",
            "--host", host, "--port", str(PROXY_PORT),
            "--registry-host", host, "--registry-port", str(REGISTRY_PORT),
            "--api-key", API_KEY, "--upstream-api-key", API_KEY,
            "--instance-timeout", "3", "--request-timeout", "60",
        )  # fmt: skip
        return Proxy(f"http://{host}:{PROXY_PORT}", REGISTRY_PORT, process, log_path)

    def serve(self, side: str, role: str, **extra: object) -> Server:
        """``pagedkv serve`` on ``side``'s address, its KV on that address too, registered
        with the proxy on P's side."""
        host = self.link.address(side)
        config = {
            "kv_connector": "P2pConnector",
            "kv_role": role,
            "kv_ip": host,
            "kv_port": KV_PORT,
            "engine_id": side.upper(),
            "kv_connector_extra_config": {
                "heartbeat_s": 0.5,
                "proxy_heartbeat_s": 0.5,
                "proxy_ip": self.link.address("p"),
                "proxy_port": REGISTRY_PORT,
                "same_host_transport": "network",
                **extra,
            },
        }
        process, log_path = self.spawn(
            side, side.upper(), "serve", str(self.model),
            "--host", host, "--port", str(HTTP_PORT),
            "--api-key", API_KEY, "--served-model-name", MODEL_NAME,
            "--kv-transfer-config", json.dumps(config),
        )  # fmt: skip
        return Server(f"http://{host}:{HTTP_PORT}", process, log_path)

    def close(self) -> None:
        for process in self.processes:
            reap(process)


@pytest.fixture(scope="module")
def linked_pair(tiny_model, tmp_path_factory) -> Iterator[SimpleNamespace]:
    require_link()
    with NetnsLink(RATE_BIT) as link:
        processes = LinkedProcesses(link, tiny_model, tmp_path_factory.mktemp("pd-link"))
        try:
            with link.entered("p"):
                proxy = processes.proxy()
                wait_healthy(proxy.base_url, proxy.process, proxy.log_path, 60)
                p = processes.serve("p", "kv_producer", send_type="PUT_ASYNC")
                d = processes.serve("d", "kv_consumer")
                for server in (p, d):
                    wait_healthy(server.base_url, server.process, server.log_path, 120)
                proxy.wait_for_instances(1, 1)
            yield SimpleNamespace(link=link, proxy=proxy, p=p, d=d)
        finally:
            processes.close()


def test_pd_across_a_shaped_link_equals_one_instance_and_its_kv_crossed_the_link(
    linked_pair, reference_text
) -> None:
    link, p, d = linked_pair.link, linked_pair.p, linked_pair.d
    lengths = (96, 130, 170, 200, 230, 240)
    prompts = [random_prompt(n, seed=700 + n) for n in lengths]
    with link.entered("p"):
        sent_before, received_before = p.metrics()[BYTES_SENT], d.metrics()[BYTES_RECEIVED]
        link_before = link.sent_bytes("p")
        client = linked_pair.proxy.client()
        start = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:  # its threads start in P's namespace
            texts = list(
                pool.map(lambda i: complete(client, prompts[i], i % 2 == 1), range(len(prompts)))
            )
        elapsed = time.monotonic() - start
        kv_bytes = p.metrics()[BYTES_SENT] - sent_before
        assert d.metrics()[BYTES_RECEIVED] - received_before == kv_bytes
        assert d.metrics()["pagedkv:prompt_tokens_total"] == len(prompts)
        wait_all_blocks_free({"P": p, "D": d})
    assert texts == reference_text(prompts, MAX_TOKENS)
    # At least the full blocks of the tokens D did not compute: 2 layers x K and V x 2 KV
    # heads x 16 x fp32 = 512 bytes a token, blocks of 16 tokens.
    assert kv_bytes >= 512 * 16 * sum((n - 1) // 16 for n in lengths)
    assert link.sent_bytes("p") - link_before >= kv_bytes
    # The bucket starts full: its first burst passes at once, the rest at the rate.
    assert elapsed >= (kv_bytes - tbf_burst_bytes(RATE_BIT)) * 8 / RATE_BIT

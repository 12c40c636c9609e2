"""Prefill/decode disaggregation over HTTP: ``pagedkv proxy`` in front of three P instances (one
per send type) and two D instances, all real ``pagedkv serve`` processes on loopback, with
HMAC-authenticated control messages."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from pagedkv.kv_transfer.p2p.protocol import MESSAGE_TYPES, Heartbeat, Want
from pagedkv.transport.codec import PROTOCOL_VERSION, Codec, Envelope
from pagedkv.transport.peer_addr import PeerAddr
from tests.entrypoints.conftest import MODEL_NAME, idle_connection_survives
from tests.kv_transfer.conftest import (
    MAX_TOKENS,
    SECRET,
    complete,
    total,
    wait_all_blocks_free,
)
from tests.load_check import short_load
from tests.tiny_models import random_prompt

PREFILLERS = {"P-put": "PUT", "P-async": "PUT_ASYNC", "P-get": "GET"}
DECODERS = ("D-0", "D-1")


@pytest.fixture(scope="module")
def xpyd(cluster_factory):
    cluster = cluster_factory()
    proxy = cluster.proxy()
    servers, configs = {}, {}
    for name, send_type in PREFILLERS.items():
        # A short lease: a P whose D died before its WANT frees within seconds (test below).
        servers[name], configs[name] = cluster.serve(
            name, "kv_producer", proxy, send_type=send_type, lease_s=3.0
        )
    for name in DECODERS:
        servers[name], configs[name] = cluster.serve(name, "kv_consumer", proxy)
    cluster.ready(*servers.values())
    proxy.wait_for_instances(len(PREFILLERS), len(DECODERS))
    return SimpleNamespace(proxy=proxy, servers=servers, configs=configs)


def test_xpyd_greedy_outputs_equal_a_single_instance_for_every_send_type(
    xpyd, reference_text
) -> None:
    servers = xpyd.servers
    prompts = [random_prompt(n, seed=100 + n) for n in (3, 16, 17, 31, 48, 64, 80, 95, 110, 127)]
    prompts += [random_prompt(40, seed=1), random_prompt(40, seed=2)]
    before_prompt = total(servers, DECODERS, "pagedkv:prompt_tokens_total")
    before_sent = {n: servers[n].metrics() for n in PREFILLERS}
    client = xpyd.proxy.client()
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = [i % 2 == 1 for i in range(len(prompts))]
        texts = list(pool.map(lambda p, s: complete(client, p, s), prompts, streams))
    assert texts == reference_text(prompts, MAX_TOKENS)
    # D computed one prompt token per request (the last, for its logits): the rest moved.
    after_prompt = total(servers, DECODERS, "pagedkv:prompt_tokens_total")
    assert after_prompt - before_prompt == len(prompts)
    wait_all_blocks_free(servers)
    delivered = "pagedkv:kv_transfer_num_sends_delivered_total"
    for name in PREFILLERS:  # round robin: every send type served 4 of the 12
        assert servers[name].metrics()[delivered] - before_sent[name][delivered] == 4, name


def test_chat_and_streaming_through_the_proxy_match_a_direct_request(xpyd) -> None:
    client = xpyd.proxy.client()
    direct = xpyd.servers["D-0"].client()  # no kv_transfer_params: computes everything itself
    kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "w5 w6 w7 w8 " * 6}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    expected = direct.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == expected
    chunks = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    wait_all_blocks_free(xpyd.servers)


def test_xpyd_under_load_answers_each_request_once_and_comes_back_to_rest(xpyd) -> None:
    """6 streaming clients through the proxy for 4 s over 3 P (one per send type) and 2 D."""
    servers = xpyd.servers
    delivered = "pagedkv:kv_transfer_num_sends_delivered_total"
    before = total(servers, PREFILLERS, delivered)
    urls = [server.base_url for server in servers.values()]
    _, results = short_load([xpyd.proxy.base_url], urls, seconds=4, clients=6)
    assert total(servers, PREFILLERS, delivered) - before == len(results)


def test_hostile_control_messages_are_rejected_logged_and_survived(xpyd) -> None:
    name = "P-async"
    server, config = xpyd.servers[name], xpyd.configs[name]
    endpoint = f"tcp://127.0.0.1:{config['kv_port']}"
    me = PeerAddr("intruder", "127.0.0.1", 1)
    signed = Codec("not-the-fingerprint", SECRET.encode(), 1 << 20, MESSAGE_TYPES)
    want = Want("t", "g", 1, "h", [[0]], [[1]])
    envelope, payload, _ = signed.encode(want, me)
    wrong_version = msgspec.msgpack.encode(Envelope(PROTOCOL_VERSION + 1, "fp", "want", me))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"just one frame"])  # malformed
        dealer.send_multipart(signed.encode(Heartbeat(["x" * (1 << 20)]), me))  # oversized
        dealer.send_multipart([envelope, payload, b"\x00" * 32])  # wrong MAC
        dealer.send_multipart([wrong_version, payload, signed._mac(wrong_version, payload)])
        dealer.send_multipart(signed.encode(want, me))  # signed, but another model's hash
        metrics = server.wait_for_metrics(
            lambda m: m.get("pagedkv:kv_transfer_num_rejected_messages_total", 0) >= 5
        )
    finally:
        dealer.close(linger=0)
        ctx.term()
    for reason in ("malformed", "oversized", "unauthenticated", "wrong_version", "incompatible"):
        assert metrics[f"pagedkv:kv_transfer_num_rejected_{reason}_total"] == 1, reason
    assert "dropped a control message" in server.log_path.read_text()
    # The listener is still serving: real transfers from this P still work.
    delivered = "pagedkv:kv_transfer_num_sends_delivered_total"
    before = metrics[delivered]
    client = xpyd.proxy.client()
    for seed in range(len(PREFILLERS)):  # round robin reaches every P
        complete(client, random_prompt(30, seed=200 + seed), stream=False)
    assert server.wait_for_metrics(lambda m: m[delivered] > before)[delivered] == before + 1


def _listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets process ``pid`` listens on: /proc/net/tcp{,6}
    joined with the socket inodes among the process's descriptors."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A = LISTEN
                    continue
                raw_address, raw_port = fields[1].split(":")
                raw = bytes.fromhex(raw_address)
                # /proc prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, words), int(raw_port, 16)))
    return found


def test_nothing_listens_beyond_loopback(xpyd) -> None:
    """Every listening socket of every process (proxy: HTTP + registry; instances: HTTP,
    ROUTER and gloo pair listeners) binds 127.0.0.1: no TCPStore or anything else on ``*``."""
    processes = {name: server.process for name, server in xpyd.servers.items()}
    processes["proxy"] = xpyd.proxy.process
    for name, process in processes.items():
        sockets = _listening_sockets(process.pid)
        assert {address for address, _ in sockets} == {"127.0.0.1"}, f"{name}: {sockets}"
        ports = {port for _, port in sockets}
        if name == "proxy":
            assert xpyd.proxy.registry_port in ports and len(ports) >= 2, ports
        else:
            assert xpyd.configs[name]["kv_port"] in ports and len(ports) >= 2, ports


def test_dead_instances_are_retried_around_and_drop_out(xpyd, reference_text) -> None:
    """Runs last in this module: it kills a P and a D."""
    servers = xpyd.servers
    for name in ("P-get", "D-1"):
        os.kill(servers[name].process.pid, signal.SIGKILL)
        servers[name].process.wait(timeout=10)
    prompts = [random_prompt(50, seed=300 + i) for i in range(6)]
    client = xpyd.proxy.client()
    texts = [complete(client, p, stream=i % 2 == 0) for i, p in enumerate(prompts)]
    assert texts == reference_text(prompts, MAX_TOKENS)
    t0 = time.monotonic()
    live = xpyd.proxy.wait_for_instances(len(PREFILLERS) - 1, len(DECODERS) - 1, timeout_s=10)
    assert time.monotonic() - t0 < 10
    assert {i["engine_id"] for i in live["prefill"] + live["decode"]} == {"P-put", "P-async", "D-0"}
    assert "failed, retrying" in xpyd.proxy.log_path.read_text()
    wait_all_blocks_free({n: servers[n] for n in ("P-put", "P-async", "D-0")})


def test_the_proxy_keeps_an_idle_connection_longer_than_its_clients_do(xpyd) -> None:
    """As for ``pagedkv serve`` (test_openai_server.py): no keep-alive race with clients."""
    assert idle_connection_survives(xpyd.proxy.base_url, idle_s=6.0)

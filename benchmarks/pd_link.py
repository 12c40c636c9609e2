#!/usr/bin/env python
"""1P1D across a shaped link: how much of the KV's time on the link shows in the TTFT.

P (PUT_ASYNC, with ``pagedkv proxy`` beside it) in one network namespace, D in another,
joined by a veth pair shaped with ``tc tbf`` to each rate in turn (``tests/netns_link.py``;
root and iproute2). A single instance, pinned to P's cores, serves the same prompts locally.
Each prompt is new (no prefix reuse), sent once to the single instance and once through the
proxy, ``max_tokens=1``: a request's latency is its TTFT. The client runs in P's namespace.

    exposed        = PD TTFT - local TTFT (same prompt; median over prompts)
    KV link time   = KV bytes (P's ``num_bytes_sent``) x 8 / rate
    one layer      = KV link time / num_layers
    target         = exposed <= 2 x one layer, where the KV link time < the prefill (local TTFT)
    KV on wire     = seconds after the PD request was sent when 5 % and 95 % of its KV had left
                     P's end of the link (sampled every 10 ms): a start near the local TTFT
                     means the KV went after P's forward, not layer by layer during it

The model (random Llama, fp32 on CPU): 8 layers, hidden 256, 8 attention heads and 8 KV heads
(no grouping: the most KV for its compute), so 16 KiB of KV a token, 128 MiB for 8k tokens:
0.5-1 s on a 1 Gbit/s link, and an 8k prefill of ~10 s on one core is affordable. The wire
also carries Ethernet, IP and TCP headers (~5 % more than the KV): the raw TCP goodput over
each rate is printed. The machine may be shared: its load is printed, figures from a busy
machine are noisy.

    sudo python benchmarks/pd_link.py                       # 1 and 10 Gbit/s, 2k and 8k tokens
    sudo python benchmarks/pd_link.py --rates 1 --tokens 2048 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from benchmarks.pd_instances import (  # noqa: E402
    Processes,
    machine_info,
    time_request,
    wait_health,
)
from tests.netns_link import DEVICE, NetnsLink, unsupported_reason  # noqa: E402

PROXY_PORT, REGISTRY_PORT, SERVE_PORT, LOCAL_PORT, KV_PORT = 8000, 30001, 8100, 8200, 14579
BYTES_SENT = "pagedkv:kv_transfer_num_bytes_sent_total"
VOCAB = 32000


@dataclass(frozen=True)
class ModelShape:
    layers: int = 8
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 8

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * 4  # fp32

    def build(self, directory: Path, max_len: int) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(1234)
        config = LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.hidden * 8 // 3,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            vocab_size=VOCAB,
            max_position_embeddings=max_len,
        )
        LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(directory)


class Deployment:
    """Proxy, P and the single instance in P's namespace, D in D's; all ended on ``close``."""

    def __init__(self, link: NetnsLink, model: Path, log_dir: Path, cores: dict[str, str]):
        self.link, self.model, self.log_dir, self.cores = link, model, log_dir, cores
        self.processes = Processes(log_dir)
        self.sampler = WireSampler(link)
        host = link.address("p")
        self.urls = {
            "local": f"http://{host}:{LOCAL_PORT}",
            "pd": f"http://{host}:{PROXY_PORT}",
            "P": f"http://{host}:{SERVE_PORT}",
            "D": f"http://{link.address('d')}:{SERVE_PORT}",
        }

    def _start(self, side: str, name: str, cores: str | None, *args: str) -> None:
        pinned = ["--cpu-cores", cores] if cores else []
        env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDKV_KV_SECRET": "bench-secret"}
        with (self.log_dir / f"{name}.log").open("w") as log:
            command = self.link.command(side, [sys.executable, "-m", "pagedkv", *args, *pinned])
            self.processes.procs.append(
                subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            )

    def _serve(self, side: str, name: str, port: int, max_len: int, config: dict | None):
        args = ["serve", str(self.model), "--host", self.link.address(side), "--port", str(port)]
        args += ["--max-model-len", str(max_len), "--log-level", "warning"]
        if config:
            args += ["--kv-transfer-config", json.dumps(config)]
        self._start(side, name, self.cores[name], *args)

    def start(self, max_len: int) -> None:
        host = self.link.address("p")
        self._start(
            "p", "proxy", None, "proxy", "--host", host, "--port", str(PROXY_PORT),
            "--registry-host", host, "--registry-port", str(REGISTRY_PORT),
            "--log-level", "warning", "--request-timeout", "600",
        )  # fmt: skip
        self._serve("p", "local", LOCAL_PORT, max_len, None)
        for side, role in (("p", "kv_producer"), ("d", "kv_consumer")):
            extra = {
                "proxy_ip": host,
                "proxy_port": REGISTRY_PORT,
                "send_type": "PUT_ASYNC",
                "same_host_transport": "network",  # the link is what is measured
            }
            config = {
                "kv_connector": "P2pConnector",
                "kv_role": role,
                "kv_ip": self.link.address(side),
                "kv_port": KV_PORT,
                "engine_id": f"bench-{side}",
                "kv_connector_extra_config": extra,
            }
            self._serve(side, side.upper(), SERVE_PORT, max_len, config)

    def wait_ready(self) -> None:
        for url in self.urls.values():
            wait_health(url, timeout_s=300)
        deadline = time.monotonic() + 60
        while True:
            live = httpx.get(f"{self.urls['pd']}/instances", timeout=5).json()
            if live["prefill"] and live["decode"]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("P and D did not register with the proxy")
            time.sleep(0.2)

    def close(self) -> None:
        self.sampler.stopped.set()
        self.processes.stop()


def metric(client: httpx.Client, url: str, name: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@dataclass
class Cell:
    """One rate and prompt length: per prompt, the local and PD TTFT and the KV P sent."""

    rate_bit: int
    tokens: int
    local: list[float] = field(default_factory=list)
    pd: list[float] = field(default_factory=list)
    kv_bytes: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    #: Seconds from sending the PD request until 5 % and 95 % of its KV had left P's end.
    wire_from: list[float] = field(default_factory=list)
    wire_to: list[float] = field(default_factory=list)


class WireSampler(threading.Thread):
    """Every 10 ms, the bytes P's end of the link has sent (``/proc/net/dev`` read from a
    thread in P's namespace): when the KV was on the wire, relative to the request."""

    def __init__(self, link: NetnsLink) -> None:
        super().__init__(daemon=True)
        self.link = link
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        with self.link.entered("p"):
            while not self.stopped.wait(0.01):
                for line in Path("/proc/thread-self/net/dev").read_text().splitlines():
                    name, _, counters = line.partition(":")
                    if name.strip() == DEVICE:
                        self.samples.append((time.perf_counter(), int(counters.split()[8])))

    def when(self, since: float, num_bytes: float) -> float:
        """Seconds after ``since`` when ``num_bytes`` more than at ``since`` had been sent."""
        before = [sent for t, sent in self.samples if t <= since]
        base = before[-1] if before else 0
        return next(
            (t - since for t, sent in self.samples if t > since and sent - base >= num_bytes),
            float("nan"),
        )


def measure(client: httpx.Client, deployment: Deployment, cell: Cell, repeats: int, gen) -> Cell:
    link, urls, sampler = deployment.link, deployment.urls, deployment.sampler
    for repeat in range(repeats):
        prompt = torch.randint(10, VOCAB, (cell.tokens,), generator=gen).tolist()
        sent, wire = metric(client, urls["P"], BYTES_SENT), link.sent_bytes("p")
        order = ("local", "pd") if repeat % 2 == 0 else ("pd", "local")
        for target in order:
            start = time.perf_counter()
            getattr(cell, target).append(time_request(client, urls[target], prompt))
            if target == "pd":
                pd_start = start
        kv = metric(client, urls["P"], BYTES_SENT) - sent
        cell.kv_bytes.append(kv)
        cell.wire_bytes.append(link.sent_bytes("p") - wire)
        cell.wire_from.append(sampler.when(pd_start, 0.05 * kv))
        cell.wire_to.append(sampler.when(pd_start, 0.95 * kv))
    return cell


def report(cell: Cell, shape: ModelShape) -> str:
    local, pd = statistics.median(cell.local), statistics.median(cell.pd)
    exposed = statistics.median(p - q for p, q in zip(cell.pd, cell.local, strict=True))
    kv = statistics.median(cell.kv_bytes)
    link_s = kv * 8 / cell.rate_bit
    layer_s = link_s / shape.layers
    verdict = ("met" if exposed <= 2 * layer_s else "missed") if link_s < local else "n/a"
    wire = statistics.median(cell.wire_bytes) / max(kv, 1)
    on_wire = f"{statistics.median(cell.wire_from):.2f}-{statistics.median(cell.wire_to):.2f}"
    return (
        f"{cell.rate_bit / 1e9:6g} {cell.tokens:6d} {kv / 2**20:6.1f} {wire:7.3f} "
        f"{link_s * 1e3:7.1f} {layer_s * 1e3:8.1f} {local * 1e3:8.0f} {pd * 1e3:8.0f} "
        f"{exposed * 1e3:8.1f} {exposed / link_s:6.2f} {exposed / layer_s:7.2f} {verdict:>7s} "
        f"{on_wire:>13s} {os.getloadavg()[0]:5.1f}"
    )


HEADER = (
    "Gbit/s tokens KV MiB wire/KV link ms layer ms local ms    PD ms  exposed  /link  /layer "
    " target  KV on wire s   load"
)


def run(args: argparse.Namespace, shape: ModelShape, tmp: Path) -> None:
    rates = [float(r) * 1e9 for r in args.rates.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    max_len = max(tokens) + 64
    shape.build(tmp / "model", max_len)
    cores = {"P": args.p_cores, "local": args.p_cores, "D": args.d_cores}
    gen = torch.Generator().manual_seed(0)
    with NetnsLink(int(rates[0])) as link:
        deployment = Deployment(link, tmp / "model", tmp, cores)
        try:
            with link.entered("p"):
                deployment.start(max_len)
                deployment.wait_ready()
                deployment.sampler.start()
                with httpx.Client(timeout=900) as client:
                    for n in tokens:  # warm both paths up at each length
                        measure(client, deployment, Cell(int(rates[0]), n), 1, gen)
                    for rate in rates:
                        link.set_rate(int(rate))
                        num_bytes = int(rate / 16)  # half a second's worth
                        goodput = num_bytes * 8 / link.send_tcp(num_bytes) / 1e9
                        print(f"-- {rate / 1e9:g} Gbit/s: raw TCP over it {goodput:.2f} Gbit/s")
                        for n in tokens:
                            cell = measure(
                                client, deployment, Cell(int(rate), n), args.repeats, gen
                            )
                            print(report(cell, shape), flush=True)
        finally:
            deployment.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rates", default="1,10", help="link rates, Gbit/s (default: %(default)s)")
    ap.add_argument("--tokens", default="2048,8192", help="prompt lengths (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="prompts per cell (default: 3)")
    ap.add_argument("--layers", type=int, default=8, help="the model's layers (default: 8)")
    ap.add_argument("--p-cores", default="0", help="P's and the one instance's cores")
    ap.add_argument("--d-cores", default="1", help="D's cores (--cpu-cores)")
    args = ap.parse_args()
    reason = unsupported_reason()
    if reason is not None:
        sys.exit(f"no shaped link here: {reason}")
    shape = ModelShape(layers=args.layers)
    print(f"machine: {machine_info()}")
    print(
        f"model: random Llama, {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, "
        f"{shape.kv_heads} KV heads, fp32: {shape.kv_bytes_per_token // 1024} KiB of KV a token; "
        f"P and local on cores {args.p_cores}, D on {args.d_cores}; PUT_ASYNC; "
        f"medians of {args.repeats} prompts"
    )
    print(HEADER)
    tmp = Path(tempfile.mkdtemp(prefix="pd_link_"))
    try:
        run(args, shape, tmp)
    except BaseException:
        print(f"the processes' logs: {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()

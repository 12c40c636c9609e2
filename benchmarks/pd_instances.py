"""The processes of a PD benchmark: a small random Llama, ``pagedkv serve`` instances (one
alone, or a P and a D behind ``pagedkv proxy``), each optionally pinned to its own cores.

Pinning: an instance pinned to ``cores`` runs its compute threads there only. When ``pagedkv
serve --help`` lists ``--cpu-cores`` the instance gets that flag; otherwise it is launched
under ``taskset -c`` with ``OMP_NUM_THREADS`` set to the number of cores. P and D take disjoint
halves of this process's CPUs (``split_cores``) and a single instance takes P's half, so it
computes a prompt on the same cores as P. The proxy and the clients are never pinned.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
#: The small Llama's vocabulary: prompts are token ids below it (no tokenizer is saved).
VOCAB_SIZE = 32000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, e.g. ``"1.2, 0.9, 0.7"``."""
    if not hasattr(os, "getloadavg"):
        return "?"
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def machine_info() -> str:
    """CPU model, cores, load, Python, torch and kernel: one line to print before figures."""
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores (load {load_average()}), "
        f"Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {platform.system()} {platform.release()}"
    )


def build_small_llama(directory: Path, max_positions: int = 16384) -> None:
    """The hf_peer anchor's tiny Llama (19M parameters, 4 layers, seed 1234), without a
    tokenizer: prompts are token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_positions,
    )
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(directory)


def split_cores() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """P's and D's cores: the first and the second half of the CPUs this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError(f"pinning P and D apart needs 2 cores or more, this process has {cores}")
    half = len(cores) // 2
    return tuple(cores[:half]), tuple(cores[half:])


#: How a benchmark's instances use the cores: P and D on disjoint halves, or anywhere.
MODES = ("pinned", "unpinned")


def add_deployment_args(ap: argparse.ArgumentParser) -> None:
    """``--modes``, ``--send-type`` and ``--transport``, as every 1P1D benchmark takes them."""
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    ap.add_argument("--send-type", default="PUT_ASYNC", choices=["PUT", "PUT_ASYNC", "GET"])
    ap.add_argument(
        "--transport",
        default=None,
        choices=["shm", "network"],
        help="same_host_transport of P and D (default: the connector's default)",
    )


def parse_modes(ap: argparse.ArgumentParser, modes: str) -> list[str]:
    """``--modes``, checked."""
    names = modes.split(",")
    if bad := [m for m in names if m not in MODES]:
        ap.error(f"--modes: {bad} not in {MODES}")
    return names


def mode_pinnings(mode: str) -> tuple[Pinning, Pinning]:
    """P's and D's pinning in ``mode`` (a single instance compared with them takes P's)."""
    if mode == "unpinned":
        return Pinning(), Pinning()
    p_cores, d_cores = split_cores()
    return Pinning(p_cores), Pinning(d_cores)


@functools.cache
def serve_has_cpu_cores_flag() -> bool:
    """Whether ``pagedkv serve --help`` lists ``--cpu-cores``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pagedkv", "serve", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    return "--cpu-cores" in out.stdout


@dataclass(frozen=True)
class Pinning:
    """Where an instance computes: ``cores`` (None: anywhere, with its default threads)."""

    cores: tuple[int, ...] | None = None

    @property
    def how(self) -> str:
        if self.cores is None:
            return "unpinned"
        cores = ",".join(map(str, self.cores))
        if serve_has_cpu_cores_flag():
            return f"--cpu-cores {cores}"
        return f"taskset -c {cores}, OMP_NUM_THREADS={len(self.cores)}"

    def apply(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """``argv`` (a ``pagedkv serve`` command line) pinned; sets ``env``'s threads if
        launched under taskset."""
        if self.cores is None:
            return argv
        cores = ",".join(map(str, self.cores))
        if serve_has_cpu_cores_flag():
            return [*argv, "--cpu-cores", cores]
        env["OMP_NUM_THREADS"] = str(len(self.cores))
        return ["taskset", "-c", cores, *argv]


class Processes:
    """Every process of one run, each logging to ``log_dir/<name>.log``; all stopped by
    ``stop``. Each gets the repository on its path and one KV secret."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], pinning: Pinning = Pinning()) -> subprocess.Popen:
        """Any command; a ``pagedkv serve`` command line pinned as asked."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDKV_KV_SECRET": "bench-secret"}
        argv = pinning.apply(argv, env)
        log = (self.log_dir / f"{name}.log").open("w")
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def serve(self, name: str, port: int, *extra: str, pinning: Pinning = Pinning()) -> str:
        """``pagedkv serve --port PORT *extra``; its URL (not waited for)."""
        argv = [sys.executable, "-m", "pagedkv", "serve", "--port", str(port), *extra]
        self.start(name, argv, pinning)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def time_request(client, url: str, prompt: list[int]) -> float:
    """Seconds until the one-token answer to ``prompt`` came back (its TTFT)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - t0
    response.raise_for_status()
    if response.json()["choices"][0]["finish_reason"] != "length":
        raise RuntimeError(f"{url}: {response.text[:300]}")
    return elapsed


def wait_health(url: str, timeout_s: float = 300) -> None:
    """Until ``url/health`` answers 200."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s:g} s")


@dataclass(frozen=True)
class PDSetup:
    """How a 1P1D deployment moves KV: ``send_type`` and ``transport`` (the connector's
    ``same_host_transport``; None: its default)."""

    send_type: str = "PUT_ASYNC"
    transport: str | None = None

    def kv_config(self, role: str, engine_id: str, registry_port: int) -> str:
        extra = {"send_type": self.send_type, "proxy_ip": "127.0.0.1", "proxy_port": registry_port}
        if self.transport is not None:
            extra["same_host_transport"] = self.transport
        config = {
            "kv_connector": "P2pConnector",
            "kv_role": role,
            "kv_port": free_port(),
            "engine_id": engine_id,
            "kv_connector_extra_config": extra,
        }
        return json.dumps(config)


def start_single(procs: Processes, serve_args: list[str], pinning: Pinning) -> str:
    """One plain instance; its URL once healthy."""
    url = procs.serve("single", free_port(), *serve_args, pinning=pinning)
    wait_health(url)
    return url


def start_1p1d(
    procs: Processes, serve_args: list[str], setup: PDSetup, p: Pinning, d: Pinning
) -> tuple[str, list[str]]:
    """A proxy, a P and a D; the proxy's URL and the instances' URLs once both registered."""
    proxy_port, registry_port = free_port(), free_port()
    proxy_args = ["--port", str(proxy_port), "--registry-port", str(registry_port)]
    proxy_argv = [sys.executable, "-m", "pagedkv", "proxy", *proxy_args, "--log-level", "warning"]
    procs.start("proxy", proxy_argv)
    instance_urls = []
    for role, name, pinning in (("kv_producer", "P", p), ("kv_consumer", "D", d)):
        config = setup.kv_config(role, f"bench-{name}", registry_port)
        extra = [*serve_args, "--kv-transfer-config", config]
        instance_urls.append(procs.serve(name, free_port(), *extra, pinning=pinning))
    for url in instance_urls:
        wait_health(url)
    proxy = f"http://127.0.0.1:{proxy_port}"
    wait_health(proxy)
    wait_registered(proxy)
    return proxy, instance_urls


def wait_registered(proxy: str, timeout_s: float = 60) -> dict:
    """Until the proxy lists a prefill and a decode instance; its ``/instances``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        live = httpx.get(f"{proxy}/instances", timeout=5).json()
        if live.get("prefill") and live.get("decode"):
            return live
        if time.monotonic() > deadline:
            raise TimeoutError(f"instances did not register: {live}")
        time.sleep(0.2)


def kv_paths(proxy: str, timeout_s: float = 10.0) -> str:
    """The path KV takes between each registered instance and its peers, as ``/instances``
    reports it (e.g. ``bench-D: bench-P shm``); waits a few heartbeats for every instance to
    report a pair."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        live = httpx.get(f"{proxy}/instances", timeout=5).json()
        instances = live.get("prefill", []) + live.get("decode", [])
        if any("kv_paths" not in instance for instance in instances):
            return "not reported by this proxy"
        if all(instance["kv_paths"] for instance in instances) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return "; ".join(
        f"{instance['engine_id']}: "
        + (", ".join(f"{peer} {path}" for peer, path in instance["kv_paths"].items()) or "none")
        for instance in instances
    )

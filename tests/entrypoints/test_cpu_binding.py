"""Real engine processes on their own cores: ``pagedkv serve --cpu-cores``, an ``LLM`` pinned by
``VLLM_CPU_OMP_THREADS_BIND`` or by ``cpu_cores`` over it, read back from ``/proc``; and the
warning an instance logs when another instance on this host may run on its cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.worker.cpu_cores import OMP_THREADS_BIND_ENV, format_cpu_list, parse_cpu_list
from tests.entrypoints.conftest import (
    REPO_ROOT,
    Server,
    pagedkv_command,
    run_pagedkv,
    serve,
    subprocess_env,
)
from tests.ports import free_port

ALLOWED = sorted(os.sched_getaffinity(0))
#: The server's core and another (the same one on a one-core machine).
SERVER_CORE, OTHER_CORE = ALLOWED[0], ALLOWED[-1]
ENGINE = ("--max-model-len", "64", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4")

#: An offline engine (``LLM``) that generates, then prints its torch threads and the cores each
#: of its threads may run on.
_LLM_SCRIPT = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
import torch
from pagedkv import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory=16 << 20, max_num_seqs=4,
          **json.loads(sys.argv[2]))
llm.generate(["w1 w2"], SamplingParams(max_tokens=2), use_tqdm=False)
print(json.dumps({"threads": torch.get_num_threads(), "allowed": [
    line.split(":")[1].strip()
    for task in os.listdir("/proc/self/task")
    for line in open(f"/proc/self/task/{task}/status")
    if line.startswith("Cpus_allowed_list")]}))
"""


def thread_cores(pid: int) -> set[str]:
    """The distinct ``Cpus_allowed_list`` of the threads of ``pid``."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list"):
                found.add(line.split(":")[1].strip())
    return found


@pytest.fixture(scope="module")
def pinned_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from serve(tmp_path_factory, str(tiny_model), *ENGINE, "--cpu-cores", str(SERVER_CORE))


def run_llm(tiny_model: Path, env_cores: int | None, **engine_args: object) -> tuple[dict, str]:
    """(what ``_LLM_SCRIPT`` printed, its log)."""
    env = subprocess_env()
    env.pop(OMP_THREADS_BIND_ENV, None)
    if env_cores is not None:
        env[OMP_THREADS_BIND_ENV] = str(env_cores)
    result = subprocess.run(
        [sys.executable, "-c", _LLM_SCRIPT, str(tiny_model), json.dumps(engine_args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1]), result.stderr


def test_serve_runs_every_thread_on_its_cores(pinned_server: Server) -> None:
    pinned_server.assert_alive()  # the engine thread has run steps (and started its threads)
    assert thread_cores(pinned_server.process.pid) == {str(SERVER_CORE)}
    log = pinned_server.log_path.read_text()
    assert f"pinned to cores {SERVER_CORE} (1 threads, --cpu-cores)" in log


def test_an_unpinned_instance_beside_another_warns_that_they_share_cores(
    pinned_server: Server, tiny_model: Path
) -> None:
    """A ``pagedkv proxy`` running beside them runs no engine: it is never named."""
    ports = [str(free_port()), str(free_port())]
    proxy = subprocess.Popen(
        pagedkv_command("proxy", "--port", ports[0], "--registry-port", ports[1]),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        argv = ("generate", "w1", "--model", str(tiny_model), *ENGINE, "--max-tokens", "2")
        result = run_pagedkv(*argv)
        assert proxy.poll() is None, "the proxy ended before the instance looked for others"
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    assert result.returncode == 0, result.stderr
    assert "shares cores with other pagedkv instances" in result.stderr
    assert f"pid {pinned_server.process.pid} (cores {SERVER_CORE})" in result.stderr
    assert f"pid {proxy.pid} " not in result.stderr
    assert "give each its own with --cpu-cores" in result.stderr


def test_the_environment_pins_an_engine(pinned_server: Server, tiny_model: Path) -> None:
    printed, log = run_llm(tiny_model, env_cores=OTHER_CORE)
    assert printed == {"threads": 1, "allowed": [str(OTHER_CORE)] * len(printed["allowed"])}
    assert f"pinned to cores {OTHER_CORE} (1 threads, {OMP_THREADS_BIND_ENV})" in log
    sharing = f"pid {pinned_server.process.pid} (cores"
    assert (sharing in log) is (OTHER_CORE == SERVER_CORE)  # disjoint cores: no warning


def test_cpu_cores_wins_over_the_environment(pinned_server: Server, tiny_model: Path) -> None:
    """Pinned over the server's core, on purpose: pinned instances that overlap are warned too."""
    cores = format_cpu_list({SERVER_CORE, OTHER_CORE})
    printed, log = run_llm(tiny_model, env_cores=OTHER_CORE, cpu_cores=cores)
    num_cores = len(parse_cpu_list(cores))
    assert printed == {"threads": num_cores, "allowed": [cores] * len(printed["allowed"])}
    assert f"pinned to cores {cores} ({num_cores} threads, --cpu-cores)" in log
    assert f"pid {pinned_server.process.pid} (cores {SERVER_CORE})" in log

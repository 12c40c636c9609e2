"""``pagedkv serve --tensor-parallel-size 2`` as its users run it: the openai client gets one
rank's answers; SIGTERM drains and stops every rank; a rank killed under load ends the requests
in flight with an error, ``/health`` answers 503, and the server exits non-zero with no rank
left behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv import LLM, SamplingParams
from tests.entrypoints.conftest import MODEL_NAME, Server, serve


def worker_ranks(server_pid: int) -> list[int]:
    """The server's tensor-parallel worker processes still alive."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(
            next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1]
        )
        if ppid == server_pid and b"pagedkv.executor.worker_proc" in cmdline:
            pids.append(int(proc.name))
    return pids


def _start(tmp_path_factory: pytest.TempPathFactory, model: Path):
    handle = serve(tmp_path_factory, str(model), "--tensor-parallel-size", "2")
    return handle, next(handle)


def _wait_exit(server: Server, timeout: float = 30.0) -> int:
    return server.process.wait(timeout=timeout)


def test_tp2_answers_as_one_rank_and_sigterm_stops_every_rank(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prompt = "w1 w2 w3 w4 w5"
    one = LLM(str(tiny_model))
    expected = one.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    one.llm_engine.shutdown()
    handle, server = _start(tmp_path_factory, tiny_model)
    try:
        (worker,) = worker_ranks(server.process.pid)
        out = server.client().completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0
        )
        assert out.choices[0].text == expected[0].outputs[0].text
        server.process.send_signal(signal.SIGTERM)
        assert _wait_exit(server) == 0
        assert not Path(f"/proc/{worker}").exists()
        assert "ERROR" not in server.log_path.read_text()
    finally:
        handle.close()


def test_a_rank_killed_under_load_fails_the_server_visibly(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    handle, server = _start(tmp_path_factory, tiny_model)
    try:
        (worker,) = worker_ranks(server.process.pid)
        errors: list[BaseException] = []
        streaming = threading.Semaphore(0)

        def stream() -> None:
            try:
                chunks = server.client().completions.create(
                    model=MODEL_NAME, prompt="w1", max_tokens=200, stream=True,
                    extra_body={"ignore_eos": True, "min_tokens": 200},
                )  # fmt: skip
                for i, _ in enumerate(chunks):
                    if i == 0:
                        streaming.release()
            except (openai.APIError, httpx.HTTPError) as e:
                errors.append(e)

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for thread in threads:
            thread.start()
        for _ in threads:  # every stream has its first token: the rank dies mid-answer
            assert streaming.acquire(timeout=60)
        os.kill(worker, signal.SIGKILL)
        health = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and server.process.poll() is None:
            try:
                health.append(httpx.get(f"{server.base_url}/health", timeout=1).status_code)
            except httpx.HTTPError:
                break
            if 503 in health:
                break
            time.sleep(0.05)
        for thread in threads:
            thread.join(30)
        assert 503 in health
        assert len(errors) == 4
        assert _wait_exit(server) != 0, server.log_path.read_text()
        log = server.log_path.read_text()
        assert f"tensor-parallel rank 1 (pid {worker}) died (killed by SIGKILL)" in log
        assert not Path(f"/proc/{worker}").exists()
    finally:
        handle.close()

"""LLM(tensor_parallel_size=2) end to end: two ranks (a worker process beside this one) give
one rank's outputs; n > 1, structured outputs and prefix caching work under TP; a rank that
dies fails the engine at once and leaves no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from transformers import LlamaConfig

from pagedkv import LLM, SamplingParams
from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH
from pagedkv.executor.errors import RankDiedError
from pagedkv.sampling_params import StructuredOutputsParams
from tests.engine.conftest import assert_all_blocks_free
from tests.tiny_models import CONFIGS, TINY, build_checkpoint, build_tokenizer, random_prompt

PROMPTS = [random_prompt(n, seed=n) for n in (5, 17, 40, 3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name in ("llama", "qwen2_hybrid", "mistral_window"):
        directory = tmp_path_factory.mktemp(name)
        config = CONFIGS[name]()
        build_checkpoint(directory, config)
        build_tokenizer(directory, TINY["vocab_size"])
        out[name] = directory
    return out


@pytest.fixture(scope="module")
def bpe_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama over the built-in model's byte-level BPE (llguidance can spell with it)."""
    directory = tmp_path_factory.mktemp("bpe-llama")
    config = LlamaConfig(**(TINY | {"vocab_size": 4096, "eos_token_id": 0}), num_hidden_layers=2)
    build_checkpoint(directory, config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_PATH / name, directory / name)
    return directory


def worker_pids() -> list[int]:
    """This process's tensor-parallel worker ranks still alive."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        children = (task / "children").read_text().split()
        for pid in children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"pagedkv.executor.worker_proc" in cmdline:
                pids.append(int(pid))
    return pids


def tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


@pytest.mark.parametrize("name", ["llama", "qwen2_hybrid", "mistral_window"])
def test_two_ranks_give_one_ranks_greedy_outputs(checkpoints, name: str) -> None:
    one = LLM(str(checkpoints[name]))
    expected = tokens(one.generate(PROMPTS, GREEDY, use_tqdm=False))
    one.llm_engine.shutdown()
    two = LLM(str(checkpoints[name]), tensor_parallel_size=2)
    try:
        assert tokens(two.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        assert_all_blocks_free(two)
    finally:
        two.llm_engine.shutdown()
    assert worker_pids() == []


def test_n_structured_outputs_and_prefix_caching_under_tp(bpe_llama: Path) -> None:
    path = str(bpe_llama)
    params = [
        SamplingParams(temperature=0, max_tokens=8, n=3, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=8, n=2, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            seed=1,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["tensor parallel", "one rank"]),
        ),
    ]
    prompt = random_prompt(48, seed=3, vocab_size=4096)
    one = LLM(path, enable_prefix_caching=True)
    expected = [tokens(one.generate([prompt], p, use_tqdm=False)) for p in params]
    one.llm_engine.shutdown()
    two = LLM(path, tensor_parallel_size=2, enable_prefix_caching=True)
    try:
        got = [two.generate([prompt], p, use_tqdm=False) for p in params]
        assert [tokens(out) for out in got] == expected
        assert got[0][0].outputs[0].token_ids == got[0][0].outputs[2].token_ids
        assert got[2][0].outputs[0].text in ("tensor parallel", "one rank")
        assert got[1][0].num_cached_tokens >= 32  # the prompt's full blocks, cached by the first
        assert_all_blocks_free(two)
    finally:
        two.llm_engine.shutdown()


def test_a_rank_that_dies_fails_the_engine_at_once(checkpoints) -> None:
    llm = LLM(str(checkpoints["llama"]), tensor_parallel_size=2)
    (worker,) = worker_pids()
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            many = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            llm.generate(PROMPTS * 16, many, use_tqdm=False)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    deadline = time.monotonic() + 30
    while llm.llm_engine.get_num_unfinished_requests() == 0:  # killed mid-generation
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(30)
    assert not thread.is_alive() and errors, "generate neither failed nor ended"
    assert time.monotonic() - killed < 10
    assert f"tensor-parallel rank 1 (pid {worker}) died (killed by SIGKILL)" in str(errors[0])
    with pytest.raises(RankDiedError):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.llm_engine.shutdown()
    assert worker_pids() == []


def test_a_rank_that_fails_to_start_is_named(checkpoints) -> None:
    """Its process is killed while it loads: the engine's start fails at once, naming it."""
    stop = threading.Event()

    def kill_the_worker() -> None:
        while not stop.is_set():
            for pid in worker_pids():
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_the_worker)
    killer.start()
    try:
        with pytest.raises(
            RankDiedError, match=r"tensor-parallel rank 1 \(pid \d+\) failed to start"
        ):
            LLM(str(checkpoints["llama"]), tensor_parallel_size=2)
    finally:
        stop.set()
        killer.join()
    assert worker_pids() == []


def test_a_tp_size_the_model_cannot_split_is_a_clear_error(checkpoints) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=3)
    assert worker_pids() == []

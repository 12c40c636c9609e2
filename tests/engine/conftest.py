from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedkv import LLM, SamplingParams
from pagedkv.engine.request_input import RequestInput
from tests.tiny_models import CONFIGS, build_checkpoint, build_tokenizer


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoint(arch)`` -> directory of a tiny random model with a word-level tokenizer."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            directory = tmp_path_factory.mktemp(arch)
            config = CONFIGS[arch]()
            build_checkpoint(directory, config)
            build_tokenizer(directory, config.vocab_size)
            built[arch] = directory
        return built[arch]

    return get


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    cache: dict[str, PreTrainedModel] = {}

    def get(arch: str) -> PreTrainedModel:
        if arch not in cache:
            cache[arch] = AutoModelForCausalLM.from_pretrained(
                checkpoint(arch), dtype=torch.float32
            ).eval()
        return cache[arch]

    return get


def run(engine, requests: list[tuple[list[int], SamplingParams, dict | None]]) -> list:
    """Step ``engine`` until it drains (60 s at most): the finished outputs of ``requests``
    (prompt, params, kv_transfer_params), in order."""
    ids = [engine.add_request(RequestInput(p, sp, kv_transfer_params=kv)) for p, sp, kv in requests]
    done = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not drain"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


def assert_all_blocks_free(llm: LLM) -> None:
    """The engine's KV cache is intact and every block is back in the pool."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.block_pool.num_blocks - 1


@pytest.fixture
def make_llm_at() -> Iterator:
    """Build engines on model directories; after the test each must hold no request and no
    block."""
    made: list[LLM] = []

    def make(path: Path, **engine_args) -> LLM:
        llm = LLM(str(path), **engine_args)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_all_blocks_free(llm)


@pytest.fixture
def make_llm(checkpoint, make_llm_at):
    """``make_llm(arch, **engine_args)``: an engine on a tiny checkpoint (see ``make_llm_at``)."""

    def make(arch: str, **engine_args) -> LLM:
        engine_args.setdefault("max_num_seqs", 16)
        return make_llm_at(checkpoint(arch), **engine_args)

    return make

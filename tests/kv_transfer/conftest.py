"""Process fixtures for KV-transfer tests: engines (and, over HTTP, servers and the proxy) in
their own processes on loopback, each reaped at teardown whatever the test did."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.engine.conftest import checkpoint  # noqa: F401  (the session's tiny models)
from tests.kv_transfer.engine_host import EngineHost


@pytest.fixture
def start_engine(checkpoint, tmp_path) -> Iterator:  # noqa: F811
    """``start_engine(name, arch="llama", hook=None, **engine_args)`` -> a running EngineHost."""
    hosts: list[EngineHost] = []

    def start(name: str, arch: str = "llama", hook: str | None = None, **engine_args):
        host = EngineHost(checkpoint(arch), tmp_path, name, hook=hook, **engine_args)
        hosts.append(host)
        return host

    yield start
    for host in hosts:
        host.close()


@pytest.fixture(scope="session")
def reference_outputs(checkpoint):  # noqa: F811
    """``reference_outputs(arch, prompts, max_tokens)``: a single instance's greedy tokens."""
    from pagedkv import LLM, SamplingParams

    engines: dict[str, LLM] = {}

    def run(arch: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        if arch not in engines:
            engines[arch] = LLM(str(checkpoint(arch)), max_num_seqs=16)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = engines[arch].generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    return run

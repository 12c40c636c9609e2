"""Fixtures of the tiered KV cache tests: tiny engines with and without tiers."""

from __future__ import annotations

from pathlib import Path

from pagedkv import SamplingParams
from tests.engine.conftest import checkpoint, make_llm, make_llm_at  # noqa: F401 (fixtures)
from tests.kv_transfer.store.conftest import redis_server  # noqa: F401 (fixture)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
#: A pool of 40 blocks of 16 tokens: 640 tokens, a few prompts' worth.
SMALL_POOL = dict(num_gpu_blocks_override=40, block_size=16, max_num_seqs=8, max_model_len=128)


def offloading(*tiers: dict, **options) -> dict:
    """A kv_transfer_config of the offloading connector with these tiers."""
    extra = {"tiers": list(tiers), **options}
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def cpu_tier(size_gib: float = 0.002, **options) -> dict:
    return {"medium": "cpu", "size_gib": size_gib, **options}


def disk_tier(path: Path, size_gib: float = 0.004, **options) -> dict:
    return {"medium": "disk", "path": str(path), "size_gib": size_gib, **options}


def generate_each(llm, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    """One prompt at a time (each sees what the previous ones stored): the outputs."""
    return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]


def tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def connector_halves(llm):
    engine = llm.llm_engine
    return engine.scheduler.connector, engine.model_runner.kv_connector


def settle(llm) -> None:
    """Let every queued tier write end, then step twice: the first so the scheduler half hears
    of them (and decides which files of blocks not stored on every head to delete), the second
    so its worker half gets those deletes; and let the deletes end."""
    _, worker_half = connector_halves(llm)
    for lower in worker_half.lower.values():
        assert lower.writer.wait_idle(30.0)
    llm.llm_engine.step()
    llm.llm_engine.step()
    for lower in worker_half.lower.values():
        assert lower.writer.wait_idle(30.0)


def assert_tiers_idle(llm) -> None:
    """Once idle: no load in flight, no entry pending or pinned, no tier over capacity, and
    the disk tier's files are exactly its index's blocks' heads."""
    settle(llm)
    scheduler_half, worker_half = connector_halves(llm)
    assert not scheduler_half._loads and not scheduler_half._loading_keys
    for name, index in scheduler_half.tiers.items():
        assert len(index) <= index.capacity_blocks, name
        assert all(e.ready and e.pins == 0 for e in index.entries.values()), name
        assert len(index.policy) == len(index), name
    if "disk" in worker_half.lower:
        disk = scheduler_half.tiers["disk"]
        files = list(Path(worker_half.lower["disk"].backend.root).rglob("*.kv"))
        # One file per KV head of each block.
        assert len(files) == len(disk) * scheduler_half.num_kv_heads, (len(files), len(disk))

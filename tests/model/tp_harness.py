"""A test-only stand-in for the tensor-parallel executor: each rank's process runs its own
ModelRunner, Scheduler and KV cache manager, built alike, on the same requests, so every rank
schedules the same steps; after each step rank 0 broadcasts the tokens it sampled, which each
other rank hands to its runner (``accept_sampled_tokens``) and its scheduler.

``python -m tests.model.tp_harness SPEC.json`` runs one rank: SPEC names the rank, the world
size, the store file, the checkpoints and the requests of each scenario; the rank writes what its
runner returned to ``SPEC["out"]``. ``drive`` is the same loop for any group, one rank included.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.distributed.tp_group import TPGroup, init_tp_group
from pagedkv.engine.config import SchedulerConfig
from pagedkv.engine.request import Request
from pagedkv.engine.scheduler import Scheduler
from pagedkv.kv_cache.kv_cache_config import get_kv_cache_config
from pagedkv.kv_cache.kv_cache_manager import KVCacheManager
from pagedkv.model.cpu_decode_layer import CpuDecodeLayer
from pagedkv.model.llama import LlamaDecoderLayer
from pagedkv.sampling_params import SamplingParams
from pagedkv.worker.config import WorkerConfig
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.model_runner_output import ModelRunnerOutput
from pagedkv.worker.scheduler_output import GrammarBitmask

MAX_MODEL_LEN = 96
BLOCK_SIZE = 4
NUM_BLOCKS = 160


def make_runner(
    model_dir: str, tp: TPGroup, cpu_cores: str | None, enforce_eager: bool
) -> tuple[ModelRunner, Scheduler]:
    """A warmed-up fp32 CPU runner of rank ``tp.rank`` and a scheduler over its KV cache."""
    config = WorkerConfig(
        model_path=Path(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        generation_config="vllm",
        attention_backend=None,
        enforce_eager=enforce_eager,
        retune_kernels=False,
        max_num_seqs=8,
        seed=0,
        gpu_memory_utilization=0.9,
        cpu_cores=cpu_cores,
    )
    runner = ModelRunner(config, tp)
    kv_cache_config = get_kv_cache_config(
        runner.get_kv_cache_specs(BLOCK_SIZE), num_gpu_blocks_override=NUM_BLOCKS
    )
    manager = KVCacheManager(kv_cache_config, MAX_MODEL_LEN, enable_caching=False)
    runner.initialize_kv_cache(kv_cache_config)
    runner.warm_up()
    scheduler_config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=32, max_model_len=MAX_MODEL_LEN
    )
    return runner, Scheduler(scheduler_config, manager, None)


def _share_tokens(tp: TPGroup, output: ModelRunnerOutput) -> list[list[int]]:
    """Rank 0's sampled tokens (one or none per request), on every rank."""
    tokens = torch.tensor([t[0] if t else -1 for t in output.sampled_token_ids], dtype=torch.int64)
    if tp.pg is not None and tokens.numel():
        tp.pg.broadcast(tokens, 0).wait()
    return [[t] if t >= 0 else [] for t in tokens.tolist()]


def allowed_bitmask(req_id: str, allowed: list[int], vocab_size: int) -> GrammarBitmask:
    """A grammar bitmask that lets request ``req_id`` sample tokens ``[allowed[0], allowed[1])``
    only (a stand-in for a grammar's)."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=np.uint8)
    bits[allowed[0] : allowed[1]] = 1
    words = np.packbits(bits, bitorder="little").view(np.int32)
    return GrammarBitmask([req_id], words.reshape(1, -1))


def drive(
    model_dir: str, scenario: dict[str, Any], tp: TPGroup, cpu_cores: str | None = None
) -> dict:
    """Run ``scenario["requests"]`` (``prompt``, ``params``: SamplingParams keywords) to the
    end, request ``r0`` held to ``scenario["allowed"]`` tokens where it names some, with torch
    ops only where ``scenario["enforce_eager"]``; returns
    per request its tokens and logprobs as rank 0's runner returned them (``{}`` elsewhere),
    whether every other rank's outputs named the same requests with no tokens, how many
    layers took the one-call decode layer, each layer's KV heads on this rank and, where
    ``scenario["check_one_call"]``, the counts of ``_check_one_call``."""
    eager = scenario.get("enforce_eager", False)
    runner, scheduler = make_runner(model_dir, tp, cpu_cores, eager)
    checks = _check_one_call(runner) if scenario.get("check_one_call") else None
    allowed = scenario.get("allowed")
    vocab_size = runner.model_config.vocab_size
    bitmask = None if allowed is None else allowed_bitmask("r0", allowed, vocab_size)
    for i, spec in enumerate(scenario["requests"]):
        params = SamplingParams(**spec["params"])
        scheduler.add_request(Request(f"r{i}", spec["prompt"], params, params.max_tokens))
    results: dict[str, dict[str, list]] = {}
    others_empty = True
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        scheduled = bitmask is not None and "r0" in scheduler_output.num_scheduled_tokens
        output = runner.execute_model(scheduler_output, bitmask if scheduled else None)
        if not tp.is_first:
            others_empty &= output.req_ids == list(scheduler_output.num_scheduled_tokens)
            others_empty &= not any(output.sampled_token_ids) and output.logprobs is None
        sampled = _share_tokens(tp, output)
        if not tp.is_first:
            runner.accept_sampled_tokens(output.req_ids, sampled)
            output = ModelRunnerOutput(output.req_ids, sampled, num_reqs=output.num_reqs)
        scheduler.update_from_output(scheduler_output, output)
        if tp.is_first:
            _record(results, output)
    one_call = sum(layer.cpu_decode is not None for layer in runner.model.model.layers)
    kv_heads = [spec.num_kv_heads for spec in runner.get_kv_cache_specs(BLOCK_SIZE).values()]
    return {
        "results": results,
        "others_empty": others_empty,
        "one_call_layers": one_call,
        "kv_heads": kv_heads,
        "one_call_checks": checks,
    }


class _CountedDecode:
    """A layer's one-call decode, counting its calls in ``counts["one_call"]``."""

    def __init__(self, one_call: CpuDecodeLayer, counts: dict[str, int]) -> None:
        self.one_call, self.counts = one_call, counts
        self.applies = one_call.applies

    def __call__(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.counts["one_call"] += 1
        return self.one_call(*args)


def _check_one_call(runner: ModelRunner) -> dict[str, int]:
    """Make each decoder layer with a one-call decode run its modules on copies of its inputs
    first, then itself; the counts (updated as the runner runs): ``one_call``, the one-call
    decodes; ``differ``, the layer calls whose output differs from the modules' in some bit.
    (The modules write the same keys and values to the KV cache that the call then writes.)"""
    counts = {"one_call": 0, "differ": 0}
    for layer in runner.model.model.layers:
        if layer.cpu_decode is not None:
            layer.cpu_decode = _CountedDecode(layer.cpu_decode, counts)
            layer.forward = partial(_checked_forward, layer, counts)
    return counts


def _checked_forward(
    layer: LlamaDecoderLayer, counts: dict[str, int], hidden: torch.Tensor, residual, *args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    one_call, layer.cpu_decode = layer.cpu_decode, None
    copies = (hidden.clone(), None if residual is None else residual.clone())
    expected = LlamaDecoderLayer.forward(layer, *copies, *args)
    layer.cpu_decode = one_call
    got = LlamaDecoderLayer.forward(layer, hidden, residual, *args)
    bits = [t.view(torch.int32) for t in (*got, *expected)]
    counts["differ"] += not (torch.equal(bits[0], bits[2]) and torch.equal(bits[1], bits[3]))
    return got


def _record(results: dict[str, dict[str, list]], output: ModelRunnerOutput) -> None:
    for i, (req_id, tokens) in enumerate(zip(output.req_ids, output.sampled_token_ids)):
        entry = results.setdefault(req_id, {"tokens": [], "logprobs": [], "prompt_logprobs": []})
        entry["tokens"] += tokens
        logprobs = output.logprobs[i] if output.logprobs else None
        if tokens and logprobs is not None:
            entry["logprobs"].append([logprobs.token_ids, logprobs.logprobs])
        for position in output.prompt_logprobs.get(req_id, []):
            entry["prompt_logprobs"].append([position.token_ids, position.logprobs])


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank, world = spec["rank"], spec["world"]
    tp = init_tp_group(rank, world, spec["store"], timeout_s=180)
    out = {
        model_dir: {
            name: drive(model_dir, scenario, tp, cpu_cores=str(rank % 2))
            for name, scenario in spec["scenarios"].items()
        }
        for model_dir in spec["models"]
    }
    Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])

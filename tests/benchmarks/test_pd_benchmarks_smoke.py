"""The PD benchmarks' working parts: ``pd_transfer.py`` moves a small prompt's KV over every
path it times (D checks that its blocks hold P's KV) and places blocks as documented;
``pd_ttft.py`` and ``pd_load.py`` pin as documented, call ``pagedkv bench serve`` with flags it
takes and read its results. (Their full runs start four servers: run by hand.)"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import pd_instances
from benchmarks.pd_instances import Pinning
from benchmarks.pd_load import bench_serve_argv, parse_summary
from benchmarks.pd_transfer import print_markdown, run_placement
from benchmarks.pd_transfer_peer import BLOCK_SIZE, RUN_BLOCKS, block_ids
from benchmarks.pd_ttft import TTFTRow, repeats_for
from pagedkv.entrypoints.cli import make_parser


@pytest.mark.parametrize("placement", ["random", "runs", "contiguous"])
def test_block_ids_are_distinct_real_blocks_placed_as_named(placement):
    gen = torch.Generator().manual_seed(0)
    ids = block_ids(200, 40, placement, gen)
    assert len(ids) == 40 and len(set(ids.tolist())) == 40
    assert ids.min() >= 1 and ids.max() < 200  # never the null block
    steps = (ids[1:] - ids[:-1]).tolist()
    if placement == "contiguous":
        assert steps == [1] * 39
    elif placement == "runs":
        assert all(steps[i] == 1 for i in range(40 - 1) if (i + 1) % RUN_BLOCKS)


def test_every_path_moves_a_prompts_kv(capsys):
    """A 64-token prompt, scattered, over the lanes on shared memory and on gloo, raw, and
    over TCP: D's blocks hold P's KV (checked in ``time_once``), every rate > 0."""
    paths = ["shm", "gloo", "shm-raw", "gloo-raw", "tcp"]
    opts = argparse.Namespace(chunk_mib=0.25, in_flight_mib=1, threads=1, repeats=1)
    (row,) = run_placement("random", [4 * BLOCK_SIZE], paths, opts)
    assert set(row.gbps) == {*paths, "memcpy", "memcpy-N"}
    assert all(rate > 0 for rate in row.gbps.values())
    assert "gloo/TCP" in capsys.readouterr().out
    print_markdown([row], paths, 2)
    table = capsys.readouterr().out.splitlines()
    assert table[1].startswith("| placement | tokens | shm | gloo |") and "memcpy 2t" in table[1]
    assert table[3].startswith(f"| random | {4 * BLOCK_SIZE} |")


def test_pinning_uses_the_flag_when_serve_has_it_else_taskset(monkeypatch):
    argv = ["python", "-m", "pagedkv", "serve", "model"]
    assert Pinning().apply(list(argv), env := {}) == argv and env == {}
    monkeypatch.setattr(pd_instances, "serve_has_cpu_cores_flag", lambda: False)
    env = {}
    assert Pinning((0, 1)).apply(list(argv), env) == ["taskset", "-c", "0,1", *argv]
    assert env == {"OMP_NUM_THREADS": "2"}
    monkeypatch.setattr(pd_instances, "serve_has_cpu_cores_flag", lambda: True)
    assert Pinning((3,)).apply(list(argv), env := {}) == [*argv, "--cpu-cores", "3"]


def test_the_load_run_passes_flags_bench_serve_takes(tmp_path):
    args = argparse.Namespace(duration=5.0, clients=64, input_len=512, output_len=64, seed=0)
    argv = bench_serve_argv("http://127.0.0.1:1", args, ["http://a", "http://b"], tmp_path / "r")
    assert argv[3:5] == ["bench", "serve"]
    parsed = make_parser().parse_args(argv[3:])
    assert (parsed.duration, parsed.max_concurrency, parsed.input_len) == (5.0, 64, 512)
    assert parsed.check_metrics == ["http://a", "http://b"]


def test_a_load_runs_results_are_read_from_bench_serves_json(tmp_path):
    summary = {
        "completed": 10,
        "failed": 1,
        "request_throughput": 2.5,
        "output_throughput": 160.0,
        "ttft": {"mean_ms": 9.0, "p50_ms": 8.0, "p90_ms": 11.0, "p99_ms": 12.0},
        "itl": {"mean_ms": 2.0, "p50_ms": 1.5, "p90_ms": 3.0, "p99_ms": 4.0},
        "instances": {"http://a": True, "http://b": False},
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"config": {}, "summary": summary, "requests": []}))
    row = parse_summary("pinned", path)
    assert (row.completed, row.failed, row.ttft_p50_ms, row.ttft_p99_ms) == (10, 1, 8.0, 12.0)
    assert (row.output_throughput, row.itl_p50_ms, row.at_rest) == (160.0, 1.5, False)


def test_ttft_overhead_and_repeats():
    assert TTFTRow("pinned", 2048, 0.5, 0.55, 10).overhead == pytest.approx(0.10)
    assert repeats_for([256, 8192], None, quick=False) == {256: 10, 8192: 5}
    assert repeats_for([256], 4, quick=True) == {256: 4}

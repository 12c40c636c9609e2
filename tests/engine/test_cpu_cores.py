"""Core lists (``--cpu-cores``, ``VLLM_CPU_OMP_THREADS_BIND``): the syntax, the checks, which
one wins, and which processes count as pagedkv instances."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.engine.engine_args import EngineArgs
from pagedkv.entrypoints.cli import make_parser
from pagedkv.worker.co_located import is_engine_command
from pagedkv.worker.cpu_cores import (
    OMP_THREADS_BIND_ENV,
    CoreRequest,
    format_cpu_list,
    parse_cpu_list,
    requested_cores,
)

ALLOWED = sorted(os.sched_getaffinity(0))
FIRST, LAST = ALLOWED[0], ALLOWED[-1]
NOT_ALLOWED = ALLOWED[-1] + 1


@pytest.mark.parametrize(
    "text, cores",
    [
        ("0-3,6", (0, 1, 2, 3, 6)),
        ("6,0-3", (0, 1, 2, 3, 6)),
        ("0-6:2", (0, 2, 4, 6)),
        (" 1 , 0 ", (0, 1)),
        ("2,2,1-2", (1, 2)),
        ("7", (7,)),
    ],
)
def test_core_lists_read_as_taskset_writes_them(text: str, cores: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-", "-1", "0-4:0", "1,,2", "0.5", "99999"])
def test_a_malformed_core_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@given(st.sets(st.integers(0, 4096), min_size=1))
def test_a_formatted_core_list_reads_back_as_the_same_cores(cores: set[int]) -> None:
    text = format_cpu_list(cores)
    assert re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text)
    assert parse_cpu_list(text) == tuple(sorted(cores))
    # Runs are maximal: no two items could merge.
    assert len(text.split(",")) == sum(1 for c in cores if c + 1 not in cores)


@pytest.mark.parametrize(
    "cpu_cores, message",
    [
        ("x", r"cpu_cores must be a core list like 0-3,6 \('x' is not a core"),
        (0, r"cpu_cores must be a core list like 0-3,6 \(a string\), got 0"),
        ("3-1", "cpu_cores must be a core list .* empty range"),
        (str(NOT_ALLOWED), rf"core\(s\) {NOT_ALLOWED}: this process may only run on"),
    ],
)
def test_engine_args_refuse_a_bad_cpu_cores_by_name(cpu_cores: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(cpu_cores=cpu_cores)


def test_engine_args_take_cores_this_process_may_run_on() -> None:
    assert EngineArgs(cpu_cores=f"{FIRST},{LAST}").cpu_cores == f"{FIRST},{LAST}"


@pytest.mark.parametrize("command", [["serve"], ["generate", "w1"], ["bench", "throughput"]])
def test_every_command_that_starts_an_engine_takes_cpu_cores(command: list[str]) -> None:
    args = make_parser().parse_args([*command, "--cpu-cores", "0-1"])
    assert args.cpu_cores == "0-1"
    assert make_parser().parse_args(command).cpu_cores is None


def test_the_proxy_runs_no_engine_and_takes_no_cpu_cores() -> None:
    with pytest.raises(SystemExit):
        make_parser().parse_args(["proxy", "--cpu-cores", "0"])


def test_the_flag_wins_over_the_environment() -> None:
    environ = {OMP_THREADS_BIND_ENV: str(LAST)}
    assert requested_cores(str(FIRST), environ) == CoreRequest((FIRST,), "--cpu-cores")
    assert requested_cores(None, environ) == CoreRequest((LAST,), OMP_THREADS_BIND_ENV)
    assert requested_cores(None, {}) == CoreRequest(None, "")


@pytest.mark.parametrize("word", ["all", "auto", ""])
def test_all_and_auto_bind_nothing(word: str) -> None:
    assert requested_cores(None, {OMP_THREADS_BIND_ENV: word}).cores is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("0-1|2-3", "one core list per tensor-parallel rank"),
        ("zero", "VLLM_CPU_OMP_THREADS_BIND='zero': 'zero' is not a core"),
        (str(NOT_ALLOWED), f"VLLM_CPU_OMP_THREADS_BIND='{NOT_ALLOWED}': core"),
    ],
)
def test_a_bad_environment_list_is_refused_by_name(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        requested_cores(None, {OMP_THREADS_BIND_ENV: value})


@pytest.mark.parametrize(
    "argv, engine",
    [
        (["/usr/bin/python3", "-m", "pagedkv", "serve", "m"], True),
        (["/venv/bin/python", "/venv/bin/pagedkv", "serve", "--port", "1"], True),
        (["pagedkv", "generate", "w1"], True),
        (["python3.11", "-u", "-X", "dev", "-m", "pagedkv", "serve"], True),
        (["python", "-mpagedkv", "bench", "throughput"], True),
        (["python", "-m", "pagedkv", "proxy"], False),
        (["python", "-m", "pagedkv", "bench", "serve"], False),
        (["python", "-m", "pagedkv"], False),
        (["python", "-c", "pagedkv serve"], False),
        (["bash", "-c", "pagedkv serve"], False),
        (["timeout", "60", "pagedkv", "serve"], False),
        (["python", "-m", "pytest", "tests/pagedkv"], False),
        (["python", "serve.py", "pagedkv", "serve"], False),
        ([], False),
    ],
)
def test_which_processes_are_pagedkv_instances(argv: list[str], engine: bool) -> None:
    assert is_engine_command(argv) is engine

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
    rank_cpu_cores,
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
        ("0-1|2-3", "needs --tensor-parallel-size > 1"),
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
        (["python", "-m", "pagedkv.executor.worker_proc"], True),
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


@pytest.mark.parametrize(
    "cpu_cores, env, expected",
    [
        (f"{FIRST}|{LAST}", None, [f"{FIRST}", f"{LAST}"]),
        (f"{FIRST},{LAST}", None, [f"{FIRST}", f"{LAST}"]),
        (None, f"{LAST}|{FIRST}", [f"{LAST}", f"{FIRST}"]),
        (None, f"{FIRST},{LAST}", [f"{FIRST}", f"{LAST}"]),
    ],
)
@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores")
def test_each_rank_gets_its_own_cores(cpu_cores, env, expected) -> None:
    environ = {} if env is None else {OMP_THREADS_BIND_ENV: env}
    assert rank_cpu_cores(cpu_cores, 2, environ) == expected


def test_unasked_ranks_split_this_process_cores() -> None:
    cores = sorted(os.sched_getaffinity(0))
    lists = rank_cpu_cores(None, 2, {})
    if len(cores) < 2:
        assert lists == [None, None]
        return
    parts = [set(parse_cpu_list(text)) for text in lists]
    assert not parts[0] & parts[1] and len(parts[0]) == len(parts[1]) == len(cores) // 2


@pytest.mark.parametrize(
    "cpu_cores, message",
    [
        (f"{FIRST}|{FIRST}", "a core is in two ranks' lists"),
        (f"{FIRST}|{LAST}|{FIRST}", "3 lists for 2 tensor-parallel ranks"),
        (f"{FIRST}", "1 core(s) for 2 tensor-parallel ranks"),
        (f"{FIRST}|{NOT_ALLOWED}", "this process may only run on"),
    ],
)
def test_rank_core_lists_that_do_not_fit_are_refused(cpu_cores: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"--cpu-cores {cpu_cores!r}")) as info:
        rank_cpu_cores(cpu_cores, 2, {})
    assert message in str(info.value)


def test_one_rank_takes_the_list_as_given() -> None:
    assert rank_cpu_cores(f"{FIRST}", 1, {}) == [f"{FIRST}"]
    assert rank_cpu_cores(None, 1, {OMP_THREADS_BIND_ENV: f"{FIRST}"}) == [None]

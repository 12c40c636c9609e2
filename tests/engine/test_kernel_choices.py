"""Kernel choices are made once per machine: restarts of the same engine, even on a loaded
machine, apply the same ones and give bit-identical logprobs.

Each start is a process of its own (``kernel_choices_start``) on the built-in model, with the
choices file in a directory of the test's (``$PAGEDKV_KERNEL_CHOICES_DIR``) and the compiled
kernels in the shared cache. The restart runs beside one busy loop per core, as when five
starts of ``pagedkv serve`` on a loaded machine packed 13, 19, 19, 25 and 25 of the 25 layers.
The file itself (corrupt, re-tuned from the environment) is tested in ``test_tuning``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.engine.engine_args import EngineArgs
from pagedkv.entrypoints.cli import make_parser
from pagedkv.model.cpu_onednn import onednn_available
from pagedkv.model.tuning import CHOICES_DIR_ENV, RETUNE_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """One busy loop per core while the test runs."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    yield
    for hog in hogs:
        hog.kill()
        hog.wait(timeout=30)


def _env(choices_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (CHOICES_DIR_ENV, RETUNE_ENV)}
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return {**env, "PYTHONPATH": path, CHOICES_DIR_ENV: str(choices_dir), **extra}


def start(choices_dir: Path, engine_args: dict | None = None, **env: str) -> tuple[dict, str]:
    """One start: what it printed (choices applied, logprobs) and its log."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.kernel_choices_start", json.dumps(engine_args or {})],
        cwd=REPO_ROOT,
        env=_env(choices_dir, **env),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def choices_file(choices_dir: Path) -> Path:
    (path,) = choices_dir.glob("kernel_choices_*.json")
    return path


def saved(choices_dir: Path) -> dict[str, bool]:
    return json.loads(choices_file(choices_dir).read_text())["choices"]


@pytest.fixture(scope="module")
def first_start(tmp_path_factory) -> tuple[Path, dict]:
    """The first start on this (test's) machine: it times every choice and saves them."""
    choices_dir = tmp_path_factory.mktemp("kernel_choices")
    result, log = start(choices_dir)
    assert "7 timed now; saved to" in log
    return choices_dir, result


def test_a_restart_under_load_applies_the_first_starts_choices(first_start, cpu_hog) -> None:
    """The second start, on a loaded machine, times nothing: it applies what the first saved,
    which is what the first applied; greedy logprobs (prompt and output) are bit for bit the
    same."""
    choices_dir, first = first_start
    assert first["applied"] == saved(choices_dir)
    second, log = start(choices_dir)
    assert f"(cached in {choices_file(choices_dir)})" in log
    assert "timed now" not in log
    assert second == first


def test_the_engine_obeys_the_file_over_its_own_timing(first_start, tmp_path) -> None:
    """A file holding the opposite of every choice timed here: the engine applies the file's
    choices, not its own, and times nothing; outputs stay the model's up to fp32 rounding
    (carried through six layers of a random model: differences of a few 1e-4 here)."""
    _, first = first_start
    flipped = {key: not value for key, value in first["applied"].items()}
    first_file = choices_file(first_start[0])
    (tmp_path / first_file.name).write_text(json.dumps({"choices": flipped}))
    result, log = start(tmp_path)
    assert result["applied"] == flipped
    assert "cached in" in log and "timed now" not in log
    for got, want in zip(result["prompt_logprobs"], first["prompt_logprobs"], strict=True):
        for got_position, want_position in zip(got[1:], want[1:], strict=True):
            got_values, want_values = dict(got_position), dict(want_position)
            shared = got_values.keys() & want_values.keys()  # the prompt's token at least
            assert shared
            for token in shared:
                assert got_values[token] == pytest.approx(want_values[token], abs=2e-3)


def test_retune_times_again_and_rewrites_the_file(first_start, tmp_path) -> None:
    """``retune_kernels`` (``--retune-kernels``): every choice is timed again, applied, and
    the file rewritten with them (a stale entry of the same key is replaced; entries for other
    shapes stay)."""
    _, first = first_start
    name = choices_file(first_start[0]).name
    stale = {key: not value for key, value in first["applied"].items()}
    (tmp_path / name).write_text(json.dumps({"choices": {**stale, "other shape": True}}))
    result, log = start(tmp_path, {"retune_kernels": True})
    assert "7 timed now; saved to" in log
    rewritten = json.loads((tmp_path / name).read_text())
    assert rewritten["choices"] == {**result["applied"], "other shape": True}
    assert rewritten["machine"]["threads"] >= 1


def test_retune_kernels_is_an_engine_flag_of_every_command() -> None:
    parser = make_parser()
    for argv in (
        ["generate", "hi", "--retune-kernels"],
        ["serve", "--retune-kernels"],
        ["bench", "throughput", "--retune-kernels"],
    ):
        assert EngineArgs.from_cli_args(parser.parse_args(argv)).retune_kernels is True
    assert EngineArgs.from_cli_args(parser.parse_args(["generate", "hi"])).retune_kernels is False

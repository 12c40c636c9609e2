"""KernelChoices: each choice timed once per machine, kept in a small JSON file, read back."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pagedkv.model.tuning import CHOICES_DIR_ENV, RETUNE_ENV, KernelChoices


class Runs:
    """Two implementations that record their calls; ``first`` is always the slower."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def first(self) -> None:
        self.calls.append("first")
        sum(range(20_000))

    def second(self) -> None:
        self.calls.append("second")


def test_a_choice_in_the_file_is_obeyed_without_timing(tmp_path: Path) -> None:
    """The file says ``first`` is faster: that is the answer, though timing would say not, and
    neither implementation runs."""
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"choices": {"k": True}}))
    runs = Runs()
    choices = KernelChoices(path)
    assert choices.first_is_faster("k", runs.first, runs.second, repeats=3) is True
    assert runs.calls == [] and choices.source == f"cached in {path}"
    choices.save()  # nothing timed: the file is left as it was
    assert json.loads(path.read_text()) == {"choices": {"k": True}}


def test_a_choice_missing_is_timed_once_and_saved_beside_the_others(tmp_path: Path) -> None:
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"choices": {"other": True}}))
    runs = Runs()
    choices = KernelChoices(path)
    for _ in range(2):
        assert choices.first_is_faster("k", runs.first, runs.second, repeats=3) is False
    assert runs.calls == ["first", "second"] * 4  # a warm-up round and three timed, once
    assert choices.source == f"1 timed now; saved to {path}"
    choices.save()
    data = json.loads(path.read_text())
    assert data["choices"] == {"other": True, "k": False}
    assert set(data["machine"]) == {"cpu", "torch", "threads", "kernels"}
    assert list(tmp_path.iterdir()) == [path]  # the scratch directory is gone


@pytest.mark.parametrize(
    "content",
    [
        '{"choices": {"k": tr',  # cut short
        '["k"]',
        '{"machine": {}}',
        '{"choices": ["k"]}',
        '{"choices": {"k": 1}}',
        "\xff\xfe",
    ],
    ids=["truncated", "list", "no-choices", "choices-list", "not-bool", "not-utf8"],
)
def test_a_corrupt_file_is_absent_with_a_warning_and_rewritten(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "choices.json"
    path.write_bytes(content.encode("latin-1"))
    runs = Runs()
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.tuning"):
        choices = KernelChoices(path)
    assert f"kernel choices {path} unreadable" in caplog.text
    assert "treated as absent" in caplog.text
    assert choices.first_is_faster("k", runs.first, runs.second, repeats=1) is False
    assert runs.calls
    choices.save()
    assert json.loads(path.read_text())["choices"] == {"k": False}


def test_retune_times_every_choice_again(tmp_path: Path) -> None:
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"choices": {"k": True, "other": True}}))
    runs = Runs()
    choices = KernelChoices(path, retune=True)
    assert choices.first_is_faster("k", runs.first, runs.second, repeats=3) is False
    assert runs.calls
    choices.save()
    assert json.loads(path.read_text())["choices"] == {"k": False, "other": True}


def test_the_file_of_this_machine_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One file per machine in ``$PAGEDKV_KERNEL_CHOICES_DIR``; ``$PAGEDKV_RETUNE_KERNELS=1``
    re-times as ``retune`` does."""
    monkeypatch.setenv(CHOICES_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(RETUNE_ENV, raising=False)
    choices = KernelChoices.for_this_machine()
    assert choices.path.parent == tmp_path
    assert choices.path.name.startswith("kernel_choices_") and choices.path.suffix == ".json"
    assert KernelChoices.for_this_machine().path == choices.path
    choices.path.write_text(json.dumps({"choices": {"k": True}}))
    runs = Runs()
    assert KernelChoices.for_this_machine().first_is_faster("k", runs.first, runs.second, 1)
    monkeypatch.setenv(RETUNE_ENV, "1")
    assert not KernelChoices.for_this_machine().first_is_faster("k", runs.first, runs.second, 1)


def test_an_unwritable_directory_warns_and_the_choices_still_apply(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    choices = KernelChoices(blocked / "choices.json")
    runs = Runs()
    assert choices.first_is_faster("k", runs.first, runs.second, repeats=1) is False
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.tuning"):
        choices.save()
    assert "kernel choices not saved" in caplog.text

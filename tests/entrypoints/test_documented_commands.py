"""Every command in the README and in the ``--help`` examples runs as written.

The shell and Python blocks run in document order: ``pagedkv serve`` and ``pagedkv proxy`` start
in the background (and must come up), everything else must exit 0. Two rewrites, the same for
every occurrence: each port (the default 8000 included) becomes a free one (a shared machine
may hold 8000), and, unless
``PAGEDKV_DOC_COMMANDS_FULL=1``, long runs are shortened (``--num-prompts`` to 8,
``--duration`` to 3 s). Install and test-suite commands (``pip install``, ``apt-get``,
``pytest``) are what CI itself runs, so they are skipped here. ``mooncake_master`` starts in the
background like a server (it must come up: its RPC port accepts connections). A server whose port
an earlier server of the same document still holds fails the test: the document's examples
collide. A command that touches no port (``pagedkv generate``, ``bench throughput``) and already
ran as written in this test run is not run twice (the help repeats the README's).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import REPO_ROOT, subprocess_env
from tests.ports import free_port

FULL = os.environ.get("PAGEDKV_DOC_COMMANDS_FULL") == "1"
START_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 600.0
_PORT = re.compile(r"(?<=--port )\d+|(?<=--registry-port )\d+|(?<=127\.0\.0\.1:)\d+|"
                   r"(?<=localhost:)\d+|(?<=_port\":)\d+|(?<=_port=)\d+")  # fmt: skip


def blocks(markdown: str) -> list[tuple[str, str]]:
    """``(language, text)`` of each fenced block, in order."""
    return re.findall(r"```(bash|python)\n(.*?)```", markdown, flags=re.S)


def shell_commands(text: str) -> list[str]:
    """One string per command: continuation lines and quotes spanning lines joined, comments
    dropped."""
    commands, current = [], ""
    for line in text.splitlines():
        current += line + "\n"
        try:
            shlex.split(current, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if current.rstrip().endswith("\\"):
            continue
        argv = shlex.split(current.replace("\\\n", " "), comments=True)
        if argv:
            commands.append(shlex.join(argv))
        current = ""
    return commands


def with_default_port(command: str) -> str:
    """Spell out the default port 8000, so that it is remapped like the others."""
    if command.startswith("pagedkv serve") and "--port" not in command:
        return f"{command} --port 8000"
    if command.startswith("pagedkv bench serve") and "--base-url" not in command:
        return f"{command} --base-url http://127.0.0.1:8000"
    return command


_RAN_AS_WRITTEN: set[str] = set()  # port-free commands that exited 0 in this test run


def shorten(command: str) -> str:
    if FULL:
        return command
    command = re.sub(r"--num-prompts \d+", "--num-prompts 8", command)
    return re.sub(r"--duration \d+", "--duration 3", command)


class Session:
    """Runs documented commands; background servers live until ``close``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.ports: dict[str, str] = {}
        self.background: list[subprocess.Popen] = []
        self.redis: subprocess.Popen | None = None
        self.proxy_url: str | None = None
        self.registered = {"prefill": 0, "decode": 0}
        self.env = subprocess_env()
        # Commands run from a scratch directory (their outputs land there) in which relative
        # paths from the repository root, such as pagedkv/assets/default_model, still resolve.
        (log_dir / "pagedkv").symlink_to(REPO_ROOT / "pagedkv")
        (log_dir / "scripts").symlink_to(REPO_ROOT / "scripts")

    def remap(self, text: str) -> str:
        return _PORT.sub(lambda m: self.ports.setdefault(m.group(), str(free_port())), text)

    def run_shell(self, command: str) -> None:
        if command.startswith(("pip ", "apt-get ", "python -m pytest")):  # what CI itself runs
            return
        written = with_default_port(command)
        command = shorten(self.remap(written))
        if command == shorten(written) and command in _RAN_AS_WRITTEN:
            print(f"[{time.strftime('%X')}] $ {command}  (ran already)", flush=True)
            return
        print(f"[{time.strftime('%X')}] $ {command}", flush=True)
        if "redis://" in command:
            self._start_redis(command)
        argv = shlex.split(command)
        if argv[0] == "pagedkv":
            argv = [sys.executable, "-m", "pagedkv", *argv[1:]]
        if argv[2:4] in (["pagedkv", "serve"], ["pagedkv", "proxy"]):
            self._start(argv, command)
            return
        if argv[0] == "mooncake_master":
            self._start_mooncake_master(argv, command)
            return
        result = subprocess.run(
            argv, cwd=self.log_dir, env=self.env, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        if command == shorten(written):
            _RAN_AS_WRITTEN.add(command)

    def run_python(self, code: str) -> None:
        print(f"[{time.strftime('%X')}] python block", flush=True)
        result = subprocess.run(
            [sys.executable, "-c", self.remap(code)], cwd=self.log_dir, env=self.env,
            capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
        assert result.returncode == 0, f"{code}\n{result.stdout}\n{result.stderr}"

    def _start(self, argv: list[str], command: str) -> None:
        given = re.search(r"--port (\d+)", command)
        port = int(given.group(1) if given else self.remap("127.0.0.1:8000")[10:])
        url = f"http://127.0.0.1:{port}"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            pytest.fail(f"{command}: an earlier documented server still holds port {port}")
        log_path = self.log_dir / f"server-{len(self.background)}.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(
                argv, cwd=self.log_dir, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.background.append(process)
        self._wait(process, command, log_path, lambda: httpx.get(f"{url}/health", timeout=2))
        if argv[3] == "proxy":
            self.proxy_url = url
        elif "proxy_port" in command and self.proxy_url is not None:
            # A P or D is of use once the proxy knows it: the next command goes through it.
            role = "prefill" if "kv_producer" in command else "decode"
            self.registered[role] += 1
            proxy_health = f"{self.proxy_url}/health"

            def registered() -> httpx.Response:
                response = httpx.get(proxy_health, timeout=2)
                ok = response.json()[role] >= self.registered[role]
                return response if ok else httpx.Response(503)

            self._wait(process, command, log_path, registered)

    @staticmethod
    def _wait(process: subprocess.Popen, command: str, log_path: Path, probe) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, f"{command}\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"{command} not up:\n{log_path.read_text()}"
            try:
                if probe().status_code == 200:
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.3)

    def _start_mooncake_master(self, argv: list[str], command: str) -> None:
        if shutil.which("mooncake_master") is None:
            if os.environ.get("PAGEDKV_REQUIRE_MOONCAKE") == "1":
                pytest.fail("mooncake_master is not installed (the mooncake extra)")
            pytest.skip("mooncake_master is not installed: the Mooncake example needs one")
        log_path = self.log_dir / "mooncake_master.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(argv, cwd=self.log_dir, stdout=log, stderr=log)
        self.background.append(process)
        port = int(re.search(r"--rpc_port=(\d+)", command).group(1))

        def accepts() -> httpx.Response:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return httpx.Response(200)

        self._wait(process, command, log_path, accepts)

    def _start_redis(self, command: str) -> None:
        if self.redis is not None:
            return
        server = shutil.which("redis-server")
        if server is None:
            if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
                pytest.fail("redis-server is not installed")
            pytest.skip("redis-server is not installed: the store example needs one")
        port = re.search(r"redis://127\.0\.0\.1:(\d+)", command).group(1)
        self.redis = subprocess.Popen(
            [server, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)

    def close(self) -> None:
        for process in [*reversed(self.background), self.redis]:
            if process is None:
                continue
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    s = Session(tmp_path)
    yield s
    s.close()


@pytest.mark.timeout(1200)
def test_readme_commands_run_as_written(session: Session) -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    ran = 0
    for language, text in blocks(readme):
        if language == "python":
            session.run_python(text)
            ran += 1
            continue
        for command in shell_commands(text):
            session.run_shell(command)
            ran += 1
    assert ran >= 15


@pytest.mark.timeout(1200)
def test_help_examples_run_as_written(session: Session) -> None:
    from pagedkv.entrypoints.cli import _EXAMPLES

    ran = 0
    for name in ("generate", "serve", "proxy", "throughput", "bench-serve"):
        examples = _EXAMPLES[name].split("\n\n")[0].removeprefix("examples:\n")
        for command in shell_commands(examples):
            session.run_shell(command)
            ran += 1
    assert ran >= 12

"""Fixtures for the store connector: a real redis-server or mooncake_master per test, a file
store, engines."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagedkv import LLM
from pagedkv.kv_transfer.store.config import StoreConfig
from tests.engine.conftest import assert_all_blocks_free, checkpoint  # noqa: F401 (fixture)
from tests.ports import free_port

REDIS_SERVER = shutil.which("redis-server")
#: Mooncake clients of the tests lend small segments (Mooncake's minimum is 16 MiB) and keep a
#: small buffer for the bytes calls.
MOONCAKE_SETUP = {"global_segment_size": 32 << 20, "local_buffer_size": 16 << 20}


def require_redis_server() -> None:
    """Skip without redis-server, except in CI (``PAGEDKV_REQUIRE_REDIS=1``, set by
    ``.ci/run``), where a missing server must fail the run rather than skip its tests."""
    if REDIS_SERVER is not None:
        return
    message = "redis-server is not installed (apt-get install redis-server)"
    if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
        pytest.fail(message)
    pytest.skip(message)


class RedisServer:
    """A private redis-server on a loopback port: no persistence, killed at teardown."""

    def __init__(self, port: int, *extra_args: str) -> None:
        self.port = port
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def start(self, timeout_s: float = 10.0) -> None:
        assert REDIS_SERVER is not None
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with redis.Redis(port=self.port, socket_timeout=0.5) as r:
                    r.ping()
                return
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    require_redis_server()
    server = RedisServer(free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


def mooncake_binary(name: str) -> Path:
    """A program shipped in Mooncake's wheel (``mooncake_master``, ``mooncake_client``). Skips
    without Mooncake, except in CI (``PAGEDKV_REQUIRE_MOONCAKE=1``, set by ``.ci/run``), where
    a missing client must fail the run rather than skip its tests."""
    try:
        import mooncake.store
    except ImportError as e:
        message = (
            f"Mooncake's client cannot be imported ({e}): pip install -e '.[mooncake]' "
            "(its binaries need apt-get install libibverbs1 libnuma1 libcurl4)"
        )
        if os.environ.get("PAGEDKV_REQUIRE_MOONCAKE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return Path(mooncake.store.__file__).parent / name


def wait_for_port(port: int, process: subprocess.Popen, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on port {port}") from None
            time.sleep(0.02)


class MooncakeMaster:
    """A private ``mooncake_master`` on loopback: RPC and metrics ports given, no HTTP metadata
    server (clients use P2PHANDSHAKE), metadata in memory only; killed at teardown."""

    def __init__(self, log_path: Path) -> None:
        self.binary = mooncake_binary("mooncake_master")
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mooncake://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(
                [
                    str(self.binary),
                    "--rpc_address=127.0.0.1",
                    f"--rpc_port={self.port}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={self.metrics_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for_port(self.port, self.process, "mooncake_master", timeout_s)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


class MooncakeSegmentHost:
    """``mooncake_client``: a process that only lends a segment of its memory to the store
    (a storage node without an engine), killed at ``kill``/teardown."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int, log_path: Path) -> None:
        self.port = free_port()
        with log_path.open("a") as log:
            self.process = subprocess.Popen(
                [
                    str(mooncake_binary("mooncake_client")),
                    f"--master_server_address=127.0.0.1:{master.port}",
                    "--metadata_server=P2PHANDSHAKE",
                    "--host=127.0.0.1",
                    f"--port={self.port}",
                    "--protocol=tcp",
                    f"--global_segment_size={segment_bytes}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for_port(self.port, self.process, "mooncake_client", 10.0)
        except RuntimeError:
            self.kill()
            raise

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(tmp_path / "mooncake_master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(params=["redis", "file", "mooncake"])
def store_url(request, tmp_path: Path) -> str:
    """The same scenario against Redis, a directory and Mooncake."""
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    if request.param == "mooncake":
        return request.getfixturevalue("mooncake_master").url
    return f"file://{tmp_path / 'store'}"


def store_extra_config(store_url: str, **extra) -> dict:
    """``kv_connector_extra_config`` for a store; a Mooncake client lends a small segment."""
    if store_url.startswith("mooncake://"):
        extra["mooncake"] = {**MOONCAKE_SETUP, **extra.get("mooncake", {})}
    return {"store_url": store_url, **extra}


def store_kv_config(store_url: str, role: str, **extra) -> dict:
    policy = extra.pop("kv_load_failure_policy", None)
    config = {
        "kv_connector": "StoreConnector",
        "kv_role": role,
        "kv_connector_extra_config": store_extra_config(store_url, **extra),
    }
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return config


@pytest.fixture
def make_llm(checkpoint) -> Iterator:  # noqa: F811
    """Engines for a test; afterwards each must hold no request and no block, and its
    connector threads are stopped (also when the test failed)."""
    made: list[LLM] = []

    def make(arch: str, **engine_args) -> LLM:
        engine_args.setdefault("max_num_seqs", 16)
        llm = LLM(str(checkpoint(arch)), **engine_args)
        made.append(llm)
        return llm

    try:
        yield make
        for llm in made:
            assert_all_blocks_free(llm)
    finally:
        for llm in made:
            llm.llm_engine.shutdown()


def backend_for(url: str, **extra):
    """A backend client of the test's own, to inspect or tamper with the store."""
    from pagedkv.kv_transfer.store.backends import create_backend

    return create_backend(StoreConfig.from_extra_config(store_extra_config(url, **extra)))

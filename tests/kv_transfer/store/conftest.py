"""Fixtures for the store connector: a real redis-server per test, a file store, engines."""

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

REDIS_SERVER = shutil.which("redis-server")


def require_redis_server() -> None:
    """Skip without redis-server, except in CI (``PAGEDKV_REQUIRE_REDIS=1``, set by
    ``.ci/run``), where a missing server must fail the run rather than skip its tests."""
    if REDIS_SERVER is not None:
        return
    message = "redis-server is not installed (apt-get install redis-server)"
    if os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture(params=["redis", "file"])
def store_url(request, tmp_path: Path) -> str:
    """The same scenario against Redis and against a directory."""
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    return f"file://{tmp_path / 'store'}"


def store_kv_config(store_url: str, role: str, **extra) -> dict:
    policy = extra.pop("kv_load_failure_policy", None)
    config = {
        "kv_connector": "StoreConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"store_url": store_url, **extra},
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


def backend_for(url: str):
    """A backend client of the test's own, to inspect or tamper with the store."""
    from pagedkv.kv_transfer.store.backends import create_backend

    return create_backend(StoreConfig(store_url=url))

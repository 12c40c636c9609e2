"""StoreConfig: the store connector's ``kv_connector_extra_config``, validated once.

{"store_url": "redis://127.0.0.1:6379/0",   # or rediss://, redis+cluster://, file:///dir,
                                             # mooncake://master-host:50051
 "load_mode": "async",          # async: WAITING_FOR_REMOTE_KVS + loader thread; sync: in-step
 "ttl_s": null,                 # expire stored blocks after this many seconds (null: never)
 "timeout_s": 2.0,              # every store call (socket timeout)
 "connect_timeout_s": 1.0,
 "put_queue_mb": 256,           # snapshots waiting for the writer; beyond it puts are dropped
 "flush_timeout_s": 5.0,        # longest a finished request's blocks wait for its puts
 "remote_prefill_wait_s": 2.0,  # D waits this long for blocks P announced but not yet stored
 "fsync": false,                # file backend: fsync each value before it becomes visible
 "mooncake": {...}}             # mooncake backend: setup() arguments (see mooncake_backend)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pagedkv.known_keys import from_known_keys

LOAD_MODES = ("async", "sync")
URL_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "file", "mooncake")


def _positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        none = " or null" if allow_none else ""
        raise ValueError(
            f"kv_connector_extra_config.{name} must be a number > 0{none}, got {value!r}"
        )


@dataclass(frozen=True)
class StoreConfig:
    store_url: str = ""
    load_mode: str = "async"
    ttl_s: float | None = None
    timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    put_queue_mb: float = 256
    flush_timeout_s: float = 5.0
    remote_prefill_wait_s: float = 2.0
    fsync: bool = False
    mooncake: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.store_url == "":
            raise ValueError(
                "StoreConnector needs kv_connector_extra_config.store_url, e.g. "
                '{"store_url": "redis://127.0.0.1:6379/0"} or {"store_url": "file:///dir"}'
            )
        if not isinstance(self.store_url, str) or "://" not in self.store_url:
            raise ValueError(
                "kv_connector_extra_config.store_url must be a URL such as "
                f"redis://127.0.0.1:6379/0 or file:///path/to/dir, got {self.store_url!r}"
            )
        if self.scheme not in URL_SCHEMES:
            raise ValueError(
                f"kv_connector_extra_config.store_url: unknown scheme {self.scheme!r}; "
                f"use one of {', '.join(URL_SCHEMES)}"
            )
        if self.scheme == "file" and not urlsplit(self.store_url).path:
            raise ValueError("kv_connector_extra_config.store_url: file:// needs a directory")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(
                f"kv_connector_extra_config.load_mode must be one of {LOAD_MODES}, "
                f"got {self.load_mode!r}"
            )
        _positive("ttl_s", self.ttl_s, allow_none=True)
        for name in ("timeout_s", "connect_timeout_s", "put_queue_mb", "flush_timeout_s"):
            _positive(name, getattr(self, name))
        if isinstance(self.remote_prefill_wait_s, bool) or not (
            isinstance(self.remote_prefill_wait_s, int | float) and self.remote_prefill_wait_s >= 0
        ):
            raise ValueError(
                "kv_connector_extra_config.remote_prefill_wait_s must be a number "
                f">= 0, got {self.remote_prefill_wait_s!r}"
            )
        if not isinstance(self.fsync, bool):
            raise ValueError(
                f"kv_connector_extra_config.fsync must be true or false, got {self.fsync!r}"
            )
        if not isinstance(self.mooncake, dict):
            raise ValueError("kv_connector_extra_config.mooncake must be an object")

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> StoreConfig:
        return from_known_keys(cls, extra, "StoreConnector option(s) in kv_connector_extra_config")

    @property
    def scheme(self) -> str:
        return self.store_url.split("://", 1)[0].lower()

    @property
    def put_queue_bytes(self) -> int:
        return int(self.put_queue_mb * (1 << 20))

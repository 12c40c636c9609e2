"""OffloadingConfig: the offloading connector's ``kv_connector_extra_config``, validated once.

{"tiers": [{"medium": "cpu", "size_gib": 4, "eviction": "lru"},        # host memory
           {"medium": "disk", "path": "/var/cache/pagedkv", "size_gib": 50,
            "eviction": "arc", "fsync": false},                           # a local directory
           {"medium": "remote", "store_url": "redis://127.0.0.1:6379/0"}], # a store backend
 "max_parallel_loads": 4,      # requests loading at once (one thread each)
 "write_queue_mb": 256}        # per lower tier: snapshots waiting for its writer; beyond, dropped

Tiers are listed top to bottom, each medium at most once: cpu, then disk, then remote. A remote
tier takes the store connector's options (``store_url``, ``ttl_s``, ``timeout_s``, ...: see
``store/config.py``); its capacity and eviction are the store's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.known_keys import from_known_keys
from pagedkv.kv_cache.kv_events import CPU, DISK, REMOTE
from pagedkv.kv_transfer.store.config import StoreConfig

GIB = 1 << 30
#: Tier media in their order, top to bottom, with their KV-events name.
MEDIA = {"cpu": CPU, "disk": DISK, "remote": REMOTE}
EVICTION_POLICY_NAMES = ("lru", "arc")


def _check_number(name: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
        what = "an integer" if integer else "a number"
        raise ValueError(f"kv_connector_extra_config.{name} must be {what} > 0, got {value!r}")


@dataclass(frozen=True)
class TierConfig:
    medium: str
    size_gib: float | None = None
    eviction: str = "lru"
    path: str | None = None
    fsync: bool = False
    #: remote: the store connector's options.
    store: StoreConfig | None = None

    @property
    def event_medium(self) -> str:
        return MEDIA[self.medium]

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.size_gib is None else int(self.size_gib * GIB)

    @classmethod
    def from_dict(cls, index: int, raw: Any) -> TierConfig:
        where = f"tiers[{index}]"
        if not isinstance(raw, dict):
            raise ValueError(f"kv_connector_extra_config.{where} must be an object")
        medium = raw.get("medium")
        if medium not in MEDIA:
            raise ValueError(
                f"kv_connector_extra_config.{where}.medium must be one of {list(MEDIA)}, "
                f"got {medium!r}"
            )
        if medium == "remote":
            options = {k: v for k, v in raw.items() if k != "medium"}
            return cls("remote", store=StoreConfig.from_extra_config(options))
        what = f"{medium} tier option(s) in kv_connector_extra_config.{where}"
        if "store" in raw:
            raise ValueError(f"unknown {what} ['store']")
        tier = from_known_keys(cls, raw, what)
        _check_number(f"{where}.size_gib", tier.size_gib)
        if tier.eviction not in EVICTION_POLICY_NAMES:
            raise ValueError(
                f"kv_connector_extra_config.{where}.eviction must be one of "
                f"{list(EVICTION_POLICY_NAMES)}, got {tier.eviction!r}"
            )
        if medium == "disk" and (not isinstance(tier.path, str) or not tier.path):
            raise ValueError(f"kv_connector_extra_config.{where}.path: a disk tier needs a path")
        if medium == "cpu" and tier.path is not None:
            raise ValueError(f"kv_connector_extra_config.{where}.path: only a disk tier has one")
        if not isinstance(tier.fsync, bool):
            raise ValueError(f"kv_connector_extra_config.{where}.fsync must be true or false")
        return tier


@dataclass(frozen=True)
class OffloadingConfig:
    tiers: tuple[TierConfig, ...] = field(default_factory=tuple)
    max_parallel_loads: int = 4
    write_queue_mb: float = 256

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> OffloadingConfig:
        raw = dict(extra)
        tiers = raw.pop("tiers", None)
        if not isinstance(tiers, list) or not tiers:
            raise ValueError(
                "OffloadingConnector needs kv_connector_extra_config.tiers, a list such as "
                '[{"medium": "cpu", "size_gib": 4}]'
            )
        parsed = tuple(TierConfig.from_dict(i, tier) for i, tier in enumerate(tiers))
        order = [list(MEDIA).index(tier.medium) for tier in parsed]
        if order != sorted(set(order)):
            raise ValueError(
                "kv_connector_extra_config.tiers: list each medium at most once, top to bottom "
                f"({' -> '.join(MEDIA)}), got {[tier.medium for tier in parsed]}"
            )
        config = from_known_keys(
            cls, raw, "OffloadingConnector option(s) in kv_connector_extra_config", ("tiers",)
        )
        _check_number("max_parallel_loads", config.max_parallel_loads, integer=True)
        _check_number("write_queue_mb", config.write_queue_mb)
        return cls(parsed, config.max_parallel_loads, config.write_queue_mb)

    @property
    def write_queue_bytes(self) -> int:
        return int(self.write_queue_mb * (1 << 20))

    def tier(self, medium: str) -> TierConfig | None:
        return next((tier for tier in self.tiers if tier.medium == medium), None)

"""KVEventsConfig: vLLM's ``--kv-events-config`` fields, validated (a bad one is a ValueError
naming it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.known_keys import from_known_keys

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    #: "zmq" publishes, "null" does not; None: "zmq" when events are enabled (vLLM's default).
    publisher: str | None = None
    #: The PUB socket's address. Binds 127.0.0.1 unless told otherwise (vLLM: ``tcp://*:5557``);
    #: port 0 takes a free port (the bound address is what the instance registers).
    endpoint: str = "tcp://127.0.0.1:5557"
    #: The ROUTER socket that answers replay and snapshot requests (None: none).
    replay_endpoint: str | None = None
    #: Batches kept for replay.
    buffer_steps: int = 10_000
    #: The PUB socket's high-water mark (messages queued per slow subscriber, then dropped).
    hwm: int = 100_000
    #: Batches waiting for the publisher thread; past it a step's batch is dropped (counted).
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}"
            )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://")):
                raise ValueError(
                    f"kv_events_config.{name} must be a tcp:// or ipc:// address, got {value!r}"
                )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """Events are collected and sent (the pool collects none otherwise)."""
        return self.enable_kv_cache_events and self.publisher in (None, "zmq")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> KVEventsConfig:
        return from_known_keys(cls, config, "fields of kv_events_config")

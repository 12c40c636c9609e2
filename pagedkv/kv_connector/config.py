"""kv_transfer_config: which KV connector an instance runs and in which role (vLLM's fields)."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedkv.known_keys import from_known_keys


class KVRole(enum.StrEnum):
    """What an instance does with KV (vLLM's ``kv_role``): the one definition of the roles."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"

    @property
    def produces(self) -> bool:
        """Computes prompts whose KV another instance loads (P)."""
        return self is not KVRole.CONSUMER

    @property
    def consumes(self) -> bool:
        """Loads KV that another instance computed (D)."""
        return self is not KVRole.PRODUCER


KV_ROLES = tuple(KVRole)
LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: KVRole
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    #: Bytes a connector may buffer (e.g. the GET pool on a producer).
    kv_buffer_size: int = 1_000_000_000
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    #: What a failed KV load does to its request: "fail" ends it with an error, "recompute"
    #: computes the missing part locally. None: the connector's default (``fail``, except for
    #: connectors that act as a cache, such as the store connector: ``recompute``).
    kv_load_failure_policy: str | None = None
    #: How long a request may wait for its KV before its load counts as failed.
    kv_load_timeout: float = 30.0
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError("kv_transfer_config.kv_connector must name a connector")
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role must be one of {[str(r) for r in KVRole]}, "
                f"got {self.kv_role!r}"
            )
        object.__setattr__(self, "kv_role", KVRole(self.kv_role))
        if (
            self.kv_load_failure_policy is not None
            and self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES
        ):
            raise ValueError(
                "kv_transfer_config.kv_load_failure_policy must be one of "
                f"{LOAD_FAILURE_POLICIES}, got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(
                f"kv_transfer_config.kv_port must be a port number, got {self.kv_port!r}"
            )
        if not isinstance(self.kv_buffer_size, int | float) or self.kv_buffer_size < 0:
            raise ValueError("kv_transfer_config.kv_buffer_size must be a byte count >= 0")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
        if not self.kv_load_timeout > 0:
            raise ValueError("kv_transfer_config.kv_load_timeout must be > 0 seconds")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> KVTransferConfig:
        return from_known_keys(cls, config, "kv_transfer_config field(s)")

"""What the KV cache manager reads from a request (the engine's Request satisfies it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedkv.kv_cache.block_hash import BlockHash


class KVCacheRequest(Protocol):
    request_id: str
    #: Tokens whose KV is already in the request's blocks (or loaded by a connector).
    num_computed_tokens: int
    #: Hashes of the request's full blocks, appended as tokens arrive (see ``BlockHasher``).
    block_hashes: list[BlockHash]

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

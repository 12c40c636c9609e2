"""What every case of ``tiered_cache.py`` shares: the trace mapped onto blocks, the tiny model
built for it, the pool and tier sizes, and engines made with them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from mooncake_trace import (
    BlockTokens,
    TraceRequest,
    oracle_hit_tokens,
    prompt_length,
    scaled,
    working_set_blocks,
)
from quiet_machine import wait_for_quiet

GIB = 1 << 30
#: Room per block for what a tier keeps beside the KV bytes (the store codec's header).
TIER_BLOCK_OVERHEAD = 4096


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 256
    num_layers: int = 4
    vocab_size: int = 1024


def build_model(directory: Path, shape: ModelShape, max_len: int) -> None:
    """A random Llama (fp32 on CPU), big enough that prefill costs far more than copying
    its KV: 256 hidden, 4 layers, 8 query and 4 KV heads by default."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.hidden_size * 11 // 4,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=max_len,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


@dataclass
class Setup:
    """The trace, its mapping and the sizes derived from it."""

    model_dir: str
    requests: list[TraceRequest]
    tokens: BlockTokens
    device: str
    speedup: float
    max_model_len: int
    working_set: int
    pool_blocks: int
    oracle: list[int]
    quiet_threshold: float = 1.0
    max_wait_s: float = 0.0
    block_bytes: int = 0

    @classmethod
    def plan(cls, requests: list[TraceRequest], model_dir: str, args) -> Setup:
        block_size = args.block_size
        longest = max(
            prompt_length(r, block_size) + max(1, scaled(r.output_length, block_size))
            for r in requests
        )
        max_model_len = math.ceil((longest + 1) / block_size) * block_size
        working_set = working_set_blocks(requests, block_size)
        # The engine refuses a pool that cannot hold one request of max_model_len tokens.
        pool = max(working_set // 3, max_model_len // block_size + 1)
        return cls(
            model_dir=model_dir,
            requests=requests,
            tokens=BlockTokens(block_size, args.vocab_size, seed=args.shape.seed),
            device=args.device,
            speedup=args.speedup,
            max_model_len=max_model_len,
            working_set=working_set,
            pool_blocks=pool,
            oracle=oracle_hit_tokens(requests, block_size),
            quiet_threshold=args.quiet_threshold,
            max_wait_s=args.max_wait,
        )

    def wait_for_quiet(self) -> None:
        """Before a timed run: until others use under ``quiet_threshold`` of the machine."""
        wait_for_quiet(self.quiet_threshold, self.max_wait_s)

    @property
    def block_size(self) -> int:
        return self.tokens.block_size

    def engine(self, kv_transfer_config: dict | None = None, pool_blocks: int | None = None):
        """A fresh ``LLMEngine`` with this pool (or ``pool_blocks``) and these tiers."""
        from pagedkv import LLM

        llm = LLM(
            self.model_dir,
            device=self.device,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_gpu_blocks_override=pool_blocks or self.pool_blocks,
            kv_transfer_config=kv_transfer_config,
        )
        return llm.llm_engine

    def measure_block_bytes(self) -> None:
        """KV bytes of one block (every layer), from the pool a plain engine allocates."""
        engine = self.engine()
        config = engine.kv_cache_config
        self.block_bytes = sum(t.size for t in config.kv_cache_tensors) // config.num_blocks
        engine.shutdown()

    def tier_gib(self, blocks: int) -> float:
        """GiB for ``blocks`` blocks in a tier (KV bytes plus their header's room)."""
        return blocks * (self.block_bytes + TIER_BLOCK_OVERHEAD) / GIB

    def tiers(self, host_blocks: int, disk_path: str | None = None, disk_blocks: int = 0) -> dict:
        """``kv_transfer_config`` for the OffloadingConnector: a host tier, and a disk tier
        when ``disk_path`` is given."""
        tiers: list[dict] = [{"medium": "cpu", "size_gib": self.tier_gib(host_blocks)}]
        if disk_path is not None:
            tiers.append(
                {"medium": "disk", "path": disk_path, "size_gib": self.tier_gib(disk_blocks)}
            )
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": tiers},
        }

    def random_prompt(self, length: int, seed: int) -> list[int]:
        """Token ids no trace block holds (a seed of their own)."""
        rng = np.random.default_rng((self.tokens.seed, 1 << 40, seed))
        return rng.integers(self.tokens.low, self.tokens.vocab_size, length).tolist()

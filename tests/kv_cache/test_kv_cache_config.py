"""Specs, KV cache groups and pool sizing."""

from __future__ import annotations

import pytest

from pagedkv.kv_cache import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    get_kv_cache_config,
    get_kv_cache_groups,
)
from tests.kv_cache.helpers import full_spec, make_config, swa_spec


@pytest.mark.parametrize(
    ("dtype", "page"),
    [("float32", 2048), ("float16", 1024), ("bfloat16", 1024), ("float8_e4m3fn", 512)],
)
def test_page_size_bytes(dtype, page):
    # K and V: 2 * block_size 16 * 2 heads * head_size 8 * dtype size
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=dtype)
    assert spec.page_size_bytes == page


def test_specs_are_frozen_and_hashable():
    a, b = swa_spec(32), swa_spec(32)
    assert a == b and hash(a) == hash(b)
    assert a != swa_spec(64) and a != full_spec()
    with pytest.raises(AttributeError):
        a.sliding_window = 64  # type: ignore[misc]


def test_uniform_model_is_one_group():
    specs = {f"layers.{i}": full_spec() for i in range(3)}
    groups = get_kv_cache_groups(specs)
    assert groups == [KVCacheGroupSpec(("layers.0", "layers.1", "layers.2"), full_spec())]

    # 3 layers of 1024-byte pages: 3072 bytes per block; leftovers are not a block.
    cfg = get_kv_cache_config(specs, kv_cache_memory_bytes=3072 * 11 + 3071)
    assert cfg.num_blocks == 11
    assert cfg.kv_cache_groups == tuple(groups)
    assert cfg.kv_cache_tensors == tuple(
        KVCacheTensor(size=11 * 1024, shared_by=(f"layers.{i}",)) for i in range(3)
    )
    assert (cfg.scheduler_block_size, cfg.hash_block_size) == (16, 16)
    assert get_kv_cache_config(specs, num_gpu_blocks_override=7).num_blocks == 7


def test_hybrid_groups_have_equal_layer_counts():
    # Gemma-like 1:3 pattern: 2 full layers, 6 sliding-window layers.
    full, swa = full_spec(), swa_spec(32)
    specs = {f"l{i}": full if i % 4 == 0 else swa for i in range(8)}
    groups = get_kv_cache_groups(specs)
    assert groups == [
        KVCacheGroupSpec(("l0", "l4"), full),
        KVCacheGroupSpec(("l1", "l5"), swa),
        KVCacheGroupSpec(("l2", "l6"), swa),
        KVCacheGroupSpec(("l3", "l7"), swa),
    ]
    # Groups alias the same memory: a block costs one group's pages (2 layers), not all 8.
    cfg = get_kv_cache_config(specs, kv_cache_memory_bytes=2048 * 20)
    assert cfg.num_blocks == 20
    assert cfg.kv_cache_tensors == (
        KVCacheTensor(size=20 * 1024, shared_by=("l0", "l1", "l2", "l3")),
        KVCacheTensor(size=20 * 1024, shared_by=("l4", "l5", "l6", "l7")),
    )


def test_hybrid_close_layer_counts_use_the_larger_group():
    full, swa = full_spec(), swa_spec(32)
    specs = {**{f"f{i}": full for i in range(3)}, **{f"s{i}": swa for i in range(4)}}
    # 4 < 1.5 * 3: one group per type, of up to 4 layers.
    assert get_kv_cache_groups(specs) == [
        KVCacheGroupSpec(("f0", "f1", "f2"), full),
        KVCacheGroupSpec(("s0", "s1", "s2", "s3"), swa),
    ]


def test_different_windows_are_different_groups():
    specs = {"a": swa_spec(32), "b": swa_spec(64), "c": full_spec()}
    groups = get_kv_cache_groups(specs)
    assert [g.kv_cache_spec for g in groups] == [swa_spec(32), swa_spec(64), full_spec()]


def test_hybrid_needs_equal_page_sizes():
    specs = {
        "full": full_spec(),
        "swa": SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, sliding_window=32),
    }
    with pytest.raises(ValueError, match="same page size"):
        get_kv_cache_groups(specs)


def test_block_sizes_of_a_config():
    full32 = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8)
    cfg = make_config(full32, swa_spec(32), num_blocks=5)
    assert cfg.block_sizes == [32, 16]
    assert (cfg.scheduler_block_size, cfg.hash_block_size) == (32, 16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kv_cache_memory_bytes=1024), "at least 2"),
        (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes"),
        (dict(num_gpu_blocks_override=1), "at least 2"),
        (dict(), "kv_cache_memory_bytes or num_gpu_blocks_override"),
    ],
)
def test_bad_budgets(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_kv_cache_config({"l0": full_spec()}, **kwargs)


def test_no_layers():
    with pytest.raises(ValueError, match="at least one layer"):
        get_kv_cache_groups({})

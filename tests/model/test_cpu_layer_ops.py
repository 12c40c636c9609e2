"""The compiled fp32 layer ops against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.model.activation import SiluAndMul
from pagedkv.model.cpu_layer_ops import CpuLayerOps, attach, load_cpu_layer_ops
from pagedkv.model.rms_norm import RMSNorm

# 1 row (a decode), 64 (a decode batch) and 700 (a prefill: past the rows-in-parallel threshold).
ROWS = [1, 64, 700]


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    loaded = load_cpu_layer_ops()
    assert loaded is not None, "the machine has a C++ compiler: the ops must build"
    return loaded


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_rows", ROWS)
def test_add_rms_norm_adds_in_place_and_normalises_as_torch(ops, num_rows: int) -> None:
    x, residual, weight = (
        _randn(num_rows, 96, seed=0),
        _randn(num_rows, 96, seed=1),
        _randn(96, seed=2),
    )
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-5)
    ops.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("num_rows", ROWS)
def test_rms_norm_and_silu_and_mul_equal_torch(ops, num_rows: int) -> None:
    x, weight = _randn(num_rows, 96, seed=3), _randn(96, seed=4)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (96,), weight, 1e-6))
    gate_up = _randn(num_rows, 2 * 80, seed=5) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_the_modules_give_the_same_results_with_and_without_the_ops(ops) -> None:
    norm, act = RMSNorm(96, 1e-6), SiluAndMul()
    with torch.no_grad():
        norm.weight.copy_(_randn(96, seed=6))
    x, residual, gate_up = _randn(8, 96, seed=7), _randn(8, 96, seed=8), _randn(8, 160, seed=9)
    plain = (norm(x), *norm(x, residual), act(gate_up))
    module = torch.nn.Sequential(norm, act)
    assert attach(module, ops) == 2 and norm.cpu_ops is ops and act.cpu_ops is ops
    compiled = (norm(x), *norm(x.clone(), residual.clone()), act(gate_up))
    for a, b in zip(compiled, plain):
        torch.testing.assert_close(a, b)


def test_the_ops_refuse_what_the_c_side_cannot_take(ops) -> None:
    x, weight = torch.zeros(4, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="fp32"):
        ops.rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(torch.zeros(8, 4).t(), weight, 1e-6)
    with pytest.raises(ValueError, match=r"weight \[hidden\]"):
        ops.rms_norm(x, torch.zeros(9), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.zeros(4, 9), weight, 1e-6)
    with pytest.raises(ValueError, match=r"2 \* size"):
        ops.silu_and_mul(torch.zeros(4, 7))


def _rope_inputs(num_tokens: int, num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 16):
    from pagedkv.model.config import RopeConfig
    from pagedkv.model.rotary_embedding import RotaryEmbedding

    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, seed=10)
    rope = RotaryEmbedding(head_size, RopeConfig(rope_type="default", rope_theta=10000.0))
    cos, signed_sin = rope(torch.arange(num_tokens) * 7 + 3, torch.float32)
    kv_cache = torch.zeros(2, 16, 4, num_kv_heads, head_size)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(11))[:num_tokens]
    return qkv, cos, signed_sin, kv_cache, slots


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_rotary_and_cache_equals_rope_then_reshape_and_cache(ops, num_tokens: int) -> None:
    from pagedkv.attention.paged_attention import reshape_and_cache
    from pagedkv.model.rotary_embedding import apply_rotary_emb

    qkv, cos, signed_sin, kv_cache, slots = _rope_inputs(num_tokens)
    expected_cache = kv_cache.clone()
    qk = apply_rotary_emb(qkv[:, : 6 * 16].view(num_tokens, 6, 16), cos, signed_sin)
    value = qkv[:, 6 * 16 :].view(num_tokens, 2, 16)
    reshape_and_cache(qk[:, 4:], value, expected_cache, slots)
    query = ops.rotary_and_cache(qkv, cos, signed_sin, kv_cache, slots, num_heads=4)
    assert query.is_contiguous() and query.shape == (num_tokens, 4, 16)
    torch.testing.assert_close(query, qk[:, :4])
    torch.testing.assert_close(kv_cache, expected_cache)


def test_rotary_and_cache_refuses_a_slot_outside_the_cache_and_writes_nothing(ops) -> None:
    qkv, cos, signed_sin, kv_cache, slots = _rope_inputs(3)
    slots[2] = 64  # one past the last of 16 blocks x 4 slots
    with pytest.raises(ValueError, match="token 2's slot 64 is outside the cache"):
        ops.rotary_and_cache(qkv, cos, signed_sin, kv_cache, slots, num_heads=4)
    assert not kv_cache.any()
    with pytest.raises(ValueError, match="do not match the cache"):
        ops.rotary_and_cache(qkv, cos, signed_sin, kv_cache, slots, num_heads=3)
    with pytest.raises(ValueError, match="int64"):
        ops.rotary_and_cache(qkv, cos, signed_sin, kv_cache, slots.int(), num_heads=4)

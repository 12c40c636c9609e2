"""The compiled CPU layer ops (``csrc/layer_ops.cpp``): a decoder layer's pointwise work in
four calls, fp32.

``add_rms_norm`` (vLLM's ``fused_add_rms_norm``: the residual add and the next RMSNorm in one
pass, in place), ``rms_norm``, ``silu_and_mul`` and ``rotary_and_cache`` (RoPE on q and k, k and
v written to the KV cache, the query packed for attention) replace about thirty torch ops per
layer (F.rms_norm alone is eight). Values equal torch's up to fp32 rounding (sums in another order,
libmvec's exp). ``RMSNorm``, ``SiluAndMul`` and ``LlamaAttention`` use them once ``attach``
gives them the ops; the model runner does that for an fp32 model on CPU unless
``--enforce-eager``.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagedkv.cpu_kernels import load_cpu_kernels

_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _check(*tensors: torch.Tensor) -> None:
    """The C side trusts its inputs: fp32, contiguous, on the CPU."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
            raise ValueError("layer ops: tensors must be contiguous fp32 CPU tensors")


class CpuLayerOps:
    """Typed entry points into the library; each checks shapes before a pointer crosses."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._add_rms_norm = library.fused_add_rms_norm_float32
        self._add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _FLOAT, _INT, _INT, ctypes.c_int]
        self._rms_norm = library.rms_norm_float32
        self._rms_norm.argtypes = [_PTR, _PTR, _PTR, _FLOAT, _INT, _INT, ctypes.c_int]
        self._silu_and_mul = library.silu_and_mul_float32
        self._silu_and_mul.argtypes = [_PTR, _PTR, _INT, _INT, ctypes.c_int]
        for function in (self._add_rms_norm, self._rms_norm, self._silu_and_mul):
            function.restype = None
        self._rotary_and_cache = library.rotary_and_cache_float32
        self._rotary_and_cache.argtypes = [_PTR] * 6 + [_INT] * 6 + [ctypes.c_int]
        self._rotary_and_cache.restype = _INT

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> None:
        """In place: ``residual += x``, then ``x = rms_norm(residual) * weight``;
        x, residual ``[num_rows, hidden]``, weight ``[hidden]``."""
        _check(x, residual, weight)
        if x.dim() != 2 or residual.shape != x.shape or weight.shape != x.shape[1:]:
            raise ValueError("add_rms_norm: x and residual [rows, hidden], weight [hidden]")
        num_rows, hidden = x.shape
        self._add_rms_norm(
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, num_rows, hidden,
            torch.get_num_threads(),
        )  # fmt: skip

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x) * weight`` into a new tensor; x ``[num_rows, hidden]``."""
        _check(x, weight)
        if x.dim() != 2 or weight.shape != x.shape[1:]:
            raise ValueError("rms_norm: x [rows, hidden], weight [hidden]")
        out = torch.empty_like(x)
        num_rows, hidden = x.shape
        self._rms_norm(
            out.data_ptr(), x.data_ptr(), weight.data_ptr(), eps, num_rows, hidden,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[num_rows, 2 * size]``."""
        _check(x)
        if x.dim() != 2 or x.shape[1] % 2:
            raise ValueError("silu_and_mul: x [rows, 2 * size]")
        num_rows, size = x.shape[0], x.shape[1] // 2
        out = torch.empty(num_rows, size, dtype=x.dtype)
        self._silu_and_mul(out.data_ptr(), x.data_ptr(), num_rows, size, torch.get_num_threads())
        return out

    def rotary_and_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        """RoPE on the fused projection's q and k heads, as ``apply_rotary_emb``; k and v
        written to their slots of ``kv_cache`` (as ``reshape_and_cache``); returns the rotated
        query, ``[num_tokens, num_heads, head_size]``, contiguous.

        qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]``; cos, signed_sin:
        ``[num_tokens, 1, head_size]``; kv_cache: ``[2, num_blocks, block_size, num_kv_heads,
        head_size]``; slot_mapping: int64 ``[num_tokens]``, each slot inside the cache.
        """
        _check(qkv, cos, signed_sin, kv_cache)
        num_tokens = qkv.shape[0]
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        if (
            qkv.dim() != 2
            or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_size
            or cos.shape != (num_tokens, 1, head_size)
            or signed_sin.shape != cos.shape
            or head_size % 2
        ):
            raise ValueError("rotary_and_cache: qkv, cos or signed_sin do not match the cache")
        if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
            raise ValueError("rotary_and_cache: slot_mapping must be int64, one slot per token")
        if not slot_mapping.is_contiguous():
            raise ValueError("rotary_and_cache: slot_mapping must be contiguous")
        query = torch.empty(num_tokens, num_heads, head_size, dtype=qkv.dtype)
        bad = self._rotary_and_cache(
            query.data_ptr(), qkv.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
            kv_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, num_heads, num_kv_heads,
            head_size, qkv.shape[1], num_blocks * block_size, torch.get_num_threads(),
        )  # fmt: skip
        if bad >= 0:
            raise ValueError(
                f"rotary_and_cache: token {bad}'s slot {int(slot_mapping[bad])} is outside the "
                f"cache ({num_blocks * block_size} slots)"
            )
        return query


def load_cpu_layer_ops() -> CpuLayerOps | None:
    """The ops, or None when the CPU kernels cannot be built (warned once per process)."""
    library = load_cpu_kernels()
    return None if library is None else CpuLayerOps(library)


def attach(model: nn.Module, ops: CpuLayerOps) -> int:
    """Give ``ops`` to every module of ``model`` with a ``cpu_ops`` slot (``RMSNorm``,
    ``SiluAndMul``, ``LlamaAttention``), which must run in fp32 on the CPU; returns how many
    modules took them."""
    modules = [m for m in model.modules() if hasattr(m, "cpu_ops")]
    for module in modules:
        module.cpu_ops = ops
    return len(modules)

"""One decoder layer of a one-request decode step in one compiled call
(``csrc/decode_layer.cpp``), fp32 on CPU.

With one request a decode step is small: the tiny HF-peer Llama's four layers read about 3 MB
of weights, and its layers' kernels took less time than the Python around them (about forty
module calls per step, each with its operand checks and a ctypes call). This call runs the
same kernels (``cpu_layer_ops``, ``cpu_gemv``, the paged decode kernel) in the same order with
the same thread counts, so a layer's output is bit for bit what its modules compute.

``LlamaDecoderLayer`` takes this path for a step's single decoding token when ``attach`` gave
it one and no KV connector hooks into its layers; the model runner attaches it with the other
compiled ops (fp32 on CPU, not with ``--enforce-eager``).

Under tensor parallelism the call runs the layer's two all-reduces itself (after o_proj and
after down_proj, each GEMV having added this rank's bias, as the modules do), through the
group's shared-memory all-reduce (``ShmAllReduce.call_with_group``: the same C function, the
same sequence counter, the same RuntimeError when a rank is missing), so the output is still
bit for bit the modules'. A group without shared memory (gloo only) gets no one-call layer: it
cannot all-reduce from C.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedkv.cpu_kernels import load_cpu_kernels

if TYPE_CHECKING:
    from pagedkv.attention.metadata import AttentionMetadata
    from pagedkv.distributed.shm_all_reduce import ShmAllReduce

_PTR, _INT = ctypes.c_void_p, ctypes.c_int64
_WEIGHTS = (
    "input_norm",
    "qkv",
    "qkv_bias",
    "o_proj",
    "o_proj_bias",
    "post_norm",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
)


class DecodeLayerStruct(ctypes.Structure):
    """``struct DecodeLayer`` of ``decode_layer.cpp``: the same fields in the same order."""

    _fields_ = [
        *((name, _PTR) for name in _WEIGHTS),
        *((name, _INT) for name in ("hidden", "num_heads", "num_kv_heads", "head_size")),
        ("intermediate", _INT),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def _layer_weights(layer: nn.Module) -> dict[str, torch.Tensor | None]:
    attn, mlp = layer.self_attn, layer.mlp
    return dict(
        input_norm=layer.input_layernorm.weight,
        qkv=attn.qkv_proj.weight,
        qkv_bias=attn.qkv_proj.bias,
        o_proj=attn.o_proj.weight,
        o_proj_bias=attn.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=mlp.gate_up_proj.weight,
        gate_up_bias=mlp.gate_up_proj.bias,
        down=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
    )


class CpuDecodeLayer:
    """A decoder layer's one-row decode in one call.

    ``layer`` is a ``LlamaDecoderLayer``: its norms, ``self_attn`` and ``mlp`` are read. The
    weights' addresses are taken once, here: the layer's parameters must stay where they
    are (they do after loading; this object keeps them alive). ``shm``: the collectives of the
    rank's group when the layer is a tensor-parallel shard (None: one rank). Raises ValueError
    when the layer is not one the call can run: fp32 contiguous CPU weights, both norms with
    one eps.
    """

    def __init__(
        self, library: ctypes.CDLL, layer: nn.Module, shm: ShmAllReduce | None = None
    ) -> None:
        attn = layer.self_attn
        eps = layer.input_layernorm.eps
        if layer.post_attention_layernorm.eps != eps:
            raise ValueError("decode layer: both norms must share one eps")
        weights = _layer_weights(layer)
        for name, tensor in weights.items():
            if tensor is not None and (
                tensor.dtype is not torch.float32 or not tensor.is_cpu or not tensor.is_contiguous()
            ):
                raise ValueError(f"decode layer: {name} must be a contiguous fp32 CPU tensor")
        self._weights = weights
        self._shm = shm
        self.hidden_size = layer.input_layernorm.weight.shape[0]
        self.num_kv_heads, self.head_size = attn.num_kv_heads, attn.head_dim
        self._struct = DecodeLayerStruct(
            *(None if t is None else t.data_ptr() for t in weights.values()),
            self.hidden_size,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            layer.mlp.down_proj.weight.shape[0],
            eps,
            attn.scaling,
        )
        struct_size = library.decode_layer_struct_size
        struct_size.restype = _INT
        if struct_size() != ctypes.sizeof(DecodeLayerStruct):
            raise ValueError("decode layer: DecodeLayerStruct does not match the library's")
        self._function = library.decode_layer_one_row_float32
        self._function.argtypes = (
            [_PTR, _PTR, ctypes.c_int, ctypes.POINTER(DecodeLayerStruct)]
            + [_PTR] * 3
            + [_INT] * 2
            + [_PTR] * 2
            + [_INT]
            + [_PTR] * 2
            + [ctypes.c_int]
            + [_PTR] * 3
        )
        self._function.restype = _INT

    @property
    def projection_shapes(self) -> list[tuple[int, int]]:
        """``(in_features, out_features)`` of the layer's four projections, in call order."""
        names = ("qkv", "o_proj", "gate_up", "down")
        return [tuple(self._weights[name].shape) for name in names]  # type: ignore[union-attr]

    @staticmethod
    def applies(hidden_states: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """One token, which the metadata runs as a decode (so does a one-token prefill chunk:
        it attends as a decode does)."""
        return hidden_states.shape[0] == 1 and metadata.decode_batch is not None

    def __call__(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(mlp output, residual)`` for the one decoding row ``hidden_states``
        ``[1, hidden]``, whose storage is reused for the output (``residual`` too; None: the
        first layer). cos, signed_sin: ``[1, 1, head_size]``."""
        first = residual is None
        if first:
            residual = torch.empty_like(hidden_states)
        decodes = metadata.decode_batch
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        row_shape = (1, self.hidden_size)
        if (
            hidden_states.shape != row_shape
            or residual.shape != row_shape
            or not all(t.dtype is torch.float32 for t in (hidden_states, residual, kv_cache))
            or not (hidden_states.is_contiguous() and residual.is_contiguous())
            or not kv_cache.is_contiguous()
            or (num_kv_heads, head_size) != (self.num_kv_heads, self.head_size)
            or cos.shape != (1, 1, head_size)
            or signed_sin.shape != cos.shape
        ):
            raise ValueError("decode layer: operands do not match the layer")
        if decodes is None or decodes.block_table.shape[0] != 1:
            raise ValueError("decode layer: the step must decode exactly one row")
        args = (
            hidden_states.data_ptr(), residual.data_ptr(), first, self._struct, cos.data_ptr(),
            signed_sin.data_ptr(), kv_cache.data_ptr(), num_blocks, block_size,
            metadata.slot_mapping.data_ptr(), decodes.block_table.data_ptr(),
            decodes.block_table.shape[1], decodes.seq_lens.data_ptr(),
            decodes.first_keys.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if self._shm is None:
            status = self._function(*args, None, None, None)
        else:  # a failed all-reduce raises the RuntimeError TPGroup.all_reduce would
            status = self._shm.call_with_group(self._function, *args)
        if status != 0:
            raise ValueError(
                f"decode layer: slot {int(metadata.slot_mapping[0])} is outside the cache "
                f"({num_blocks * block_size} slots)"
            )
        return hidden_states, residual


def attach(model: nn.Module) -> int:
    """Give every layer of ``model`` (a ``LlamaForCausalLM``, fp32 on the CPU, weights loaded)
    with a ``cpu_decode`` slot (``LlamaDecoderLayer``) its one-call decode; returns how many
    layers took it (0 when the kernels cannot be built, or when ``model.tp`` has several ranks
    but no shared-memory collectives)."""
    library = load_cpu_kernels()
    tp = model.tp
    if library is None or (tp.world_size > 1 and tp.shm is None):
        return 0
    layers = [m for m in model.modules() if hasattr(m, "cpu_decode")]
    for layer in layers:
        layer.cpu_decode = CpuDecodeLayer(library, layer, tp.shm)
    return len(layers)

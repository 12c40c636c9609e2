"""The one-call decoder layer for a one-request decode step, against the layer's modules with
the same compiled ops: bit for bit, on every tiny architecture."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.distributed import FileStore

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.distributed.shm_all_reduce import ShmAllReduce
from pagedkv.model import cpu_decode_layer
from pagedkv.model.cpu_decode_layer import CpuDecodeLayer
from pagedkv.model.cpu_gemv import attach as attach_gemv
from pagedkv.model.cpu_gemv import load_cpu_gemv
from pagedkv.model.cpu_layer_ops import attach as attach_ops
from pagedkv.model.cpu_layer_ops import load_cpu_layer_ops
from pagedkv.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedkv.model.loader import load_model
from tests.model.test_models import PagedRunner
from tests.tiny_models import CONFIGS, build_checkpoint, random_prompt


def _compiled_model(directory: Path, one_call: bool) -> LlamaForCausalLM:
    model = load_model(directory)
    ops, gemv = load_cpu_layer_ops(), load_cpu_gemv()
    assert ops is not None and gemv is not None, "the machine has a C++ compiler"
    attach_ops(model, ops)
    attach_gemv(model, gemv)
    if one_call:
        assert cpu_decode_layer.attach(model) == model.config.num_hidden_layers
    return model


def _compiled_runner(model: LlamaForCausalLM) -> PagedRunner:
    runner = PagedRunner(model)
    runner.backend.load_kernels(torch.device("cpu"))
    return runner


class _CountingCalls:
    """Counts the one-call layers' calls, passing each through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = CpuDecodeLayer.__call__

        def counted(layer: CpuDecodeLayer, *args, **kwargs):
            self.calls += 1
            return original(layer, *args, **kwargs)

        monkeypatch.setattr(CpuDecodeLayer, "__call__", counted)


def _assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    build_checkpoint(directory, CONFIGS[request.param]())
    return directory


def test_one_call_decode_equals_the_modules_bit_for_bit(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt, then greedy decode steps past the sliding window (null blocks hold NaN): the
    hidden states and every KV cache equal the module path's exactly, and the decode steps
    (not the prefill) went through one call per layer."""
    counting = _CountingCalls(monkeypatch)
    fused, plain = (_compiled_model(checkpoint, one_call) for one_call in (True, False))
    runners = [_compiled_runner(fused), _compiled_runner(plain)]
    prompt = random_prompt(21, seed=3, vocab_size=fused.config.vocab_size)
    num_steps = 20
    next_ids = [prompt, prompt]
    for step in range(num_steps):
        computed = 0 if step == 0 else len(prompt) + step - 1
        hidden = [r.step([(computed, ids)])[0] for r, ids in zip(runners, next_ids)]
        _assert_bit_equal(hidden[0], hidden[1])
        for fused_cache, plain_cache in zip(runners[0].kv_caches, runners[1].kv_caches):
            _assert_bit_equal(fused_cache, plain_cache)
        with torch.inference_mode():
            token = int(fused.compute_logits(hidden[0][-1:]).argmax())
        next_ids = [[token], [token]]
    assert counting.calls == (num_steps - 1) * fused.config.num_hidden_layers


def test_batches_prefills_and_connectors_take_the_modules(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two decoding rows, a two-token prefill, and a step with a KV connector's layer hooks:
    none goes through the one call."""
    counting = _CountingCalls(monkeypatch)
    model = _compiled_model(checkpoint, one_call=True)
    runner = _compiled_runner(model)
    runner.step([(0, [5, 6, 7]), (0, [8, 9])])
    runner.step([(3, [1]), (2, [2])])  # a batch of two decodes
    runner.step([(0, [3, 4])])  # request 0 again, from scratch: a prefill of two tokens

    class Hooks:
        def wait_for_layer_load(self, layer_idx: int) -> None:
            pass

        def save_kv_layer(self, layer_idx, kv_cache, metadata) -> None:
            pass

    runner.step([(2, [5])], kv_connector=Hooks())
    assert counting.calls == 0


@pytest.fixture(scope="module")
def llama_layer(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    directory = tmp_path_factory.mktemp("llama")
    build_checkpoint(directory, CONFIGS["llama"]())
    return _compiled_model(directory, one_call=True)


def _one_decode(model: LlamaForCausalLM, slot: int, num_blocks: int = 4, block_size: int = 16):
    """Operands for layer 0 decoding one token at position 5 (blocks 1 then 2 hold the keys)."""
    config = model.config
    kv_cache = torch.zeros(2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    metadata = AttentionMetadata.from_numpy(
        np.array([0, 1]), np.array([6]), np.array([[1, 2]]), np.array([slot]), block_size
    )
    cos, signed_sin = model.model.rotary_emb(torch.tensor([5]), torch.float32)
    hidden = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(0))
    return hidden, cos, signed_sin, kv_cache, metadata


def test_the_one_call_refuses_what_the_c_side_cannot_take(llama_layer) -> None:
    model = llama_layer
    layer = model.model.layers[0]
    one_call = layer.cpu_decode
    hidden, cos, signed_sin, kv_cache, metadata = _one_decode(model, slot=16 + 5)
    with pytest.raises(ValueError, match="do not match the layer"):
        one_call(hidden[:, :-1].contiguous(), None, cos, signed_sin, kv_cache, metadata)
    with pytest.raises(ValueError, match="do not match the layer"):
        one_call(hidden.double(), None, cos, signed_sin, kv_cache, metadata)
    with pytest.raises(ValueError, match="do not match the layer"):
        one_call(hidden, None, cos, signed_sin, kv_cache[:, :, :, :1].contiguous(), metadata)
    two_rows = AttentionMetadata.from_numpy(
        np.array([0, 1, 2]), np.array([6, 6]), np.array([[1, 2], [1, 2]]), np.array([21, 22]), 16
    )
    with pytest.raises(ValueError, match="exactly one row"):
        one_call(hidden, None, cos, signed_sin, kv_cache, two_rows)
    outside = _one_decode(model, slot=4 * 16)
    with pytest.raises(ValueError, match="outside the cache"):
        one_call(*outside[:1], None, *outside[1:])
    assert not outside[3].any(), "nothing written when the slot is refused"


def test_a_layer_the_call_cannot_run_is_refused(llama_layer) -> None:
    layer: LlamaDecoderLayer = llama_layer.model.layers[0]
    library = cpu_decode_layer.load_cpu_kernels()
    saved = layer.post_attention_layernorm.eps
    layer.post_attention_layernorm.eps = saved * 2
    try:
        with pytest.raises(ValueError, match="one eps"):
            CpuDecodeLayer(library, layer)
    finally:
        layer.post_attention_layernorm.eps = saved
    weight = layer.mlp.down_proj.weight
    transposed = torch.nn.Parameter(weight.detach().t().contiguous().t())
    layer.mlp.down_proj.weight = transposed
    try:
        with pytest.raises(ValueError, match="down must be a contiguous fp32 CPU tensor"):
            CpuDecodeLayer(library, layer)
    finally:
        layer.mlp.down_proj.weight = weight


def test_under_tp_a_missing_rank_raises_what_the_all_reduce_would(
    llama_layer, tmp_path: Path
) -> None:
    """Rank 0 of two, whose rank 1 never comes: the call's first all-reduce (after o_proj)
    times out and raises ``ShmAllReduce.all_reduce``'s RuntimeError, closing the group; the
    next call finds it closed."""

    def meet(rank: int) -> ShmAllReduce | None:
        store = FileStore(str(tmp_path / "store"), 2)
        store.set_timeout(datetime.timedelta(seconds=20))
        return ShmAllReduce.meet(store, rank, 2, 4096, timeout_s=0.2)

    with ThreadPoolExecutor(2) as pool:
        rank0, rank1 = pool.map(meet, range(2))
    if rank0 is None or rank1 is None:
        pytest.skip("no shared-memory path on this machine")
    library = cpu_decode_layer.load_cpu_kernels()
    one_call = CpuDecodeLayer(library, llama_layer.model.layers[0], rank0)
    hidden, cos, signed_sin, kv_cache, metadata = _one_decode(llama_layer, slot=16 + 5)
    message = "tensor-parallel all_reduce on rank 0: rank 1 did not arrive within 0.2 s"
    with pytest.raises(RuntimeError, match=message):
        one_call(hidden, None, cos, signed_sin, kv_cache, metadata)
    with pytest.raises(RuntimeError, match="shared memory is closed"):
        one_call(hidden, None, cos, signed_sin, kv_cache, metadata)
    rank1.close()


def test_a_group_without_shared_memory_gets_no_one_call(tmp_path: Path) -> None:
    """Several ranks over gloo only: the layers stay module by module."""
    build_checkpoint(tmp_path, CONFIGS["llama"]())
    model = load_model(tmp_path)
    model.tp = SimpleNamespace(world_size=2, shm=None)
    assert cpu_decode_layer.attach(model) == 0
    assert all(layer.cpu_decode is None for layer in model.model.layers)

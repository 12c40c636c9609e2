"""oneDNN against packed weights: the products of the loaded weights, in every Linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedkv.model import cpu_onednn
from pagedkv.model.cpu_onednn import onednn_available, pack_weight, packed_matmul
from pagedkv.model.linear import Linear
from pagedkv.model.lm_head import LMHead
from pagedkv.model.loader import load_model
from pagedkv.model.tuning import KernelChoices
from tests.model.test_models import hf_greedy, paged_greedy
from tests.tiny_models import CONFIGS, build_checkpoint, random_prompt

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_rows", [1, 2, 7, 64, 300])
@pytest.mark.parametrize(("in_features", "out_features"), [(1, 1), (33, 257), (256, 1376)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_products_equal_the_weights(
    num_rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    weight = _randn(in_features, out_features, seed=0)
    b = _randn(out_features, seed=1) if bias else None
    x = _randn(num_rows, in_features, seed=2)
    """Within fp32's bound for a sum of K + 1 terms in any order, against float64."""
    bias64 = torch.zeros(out_features) if b is None else b.double()
    expected = x.double() @ weight.double() + bias64
    magnitude = x.double().abs() @ weight.double().abs() + bias64.abs()
    got = packed_matmul(x, pack_weight(weight), b)
    assert got.dtype == torch.float32 and got.shape == (num_rows, out_features)
    assert ((got.double() - expected).abs() <= (in_features + 1) * 2**-24 * magnitude).all()


def test_pack_weight_refuses_what_onednn_is_not_used_for() -> None:
    with pytest.raises(ValueError, match="fp32"):
        pack_weight(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        pack_weight(torch.zeros(4))


def test_linear_and_lm_head_batches_go_through_the_packed_copy() -> None:
    """With a packed copy a batch's product is oneDNN's; the modules' answers stay the
    weights'. The packed copy is a copy: a later change to ``weight`` does not reach it."""
    linear = Linear(40, 24, bias=True)
    head = LMHead(40, 300)
    with torch.no_grad():
        linear.weight.copy_(_randn(40, 24, seed=3))
        linear.bias.copy_(_randn(24, seed=4))
        head.weight.copy_(_randn(40, 300, seed=5))
    head.prepare()
    x = _randn(9, 40, seed=6)
    for module in (linear, head):
        plain = module(x)
        module.weight_packed = pack_weight(module.weight.detach())
        torch.testing.assert_close(module(x), plain, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            module.weight.zero_()
        assert module(x).abs().sum() > 0, "the batch went through the packed copy"


def test_attach_times_each_shape_once_and_keeps_the_products(tmp_path: Path) -> None:
    """Whatever the timing decides, logits stay the weights' products, and each distinct
    weight shape is timed once (two layers share four shapes; the LM head is its own) and
    saved: a second attach to a fresh model times nothing and packs the same layers."""
    build_checkpoint(tmp_path, CONFIGS["llama"]())
    model = load_model(tmp_path)
    hidden = _randn(5, model.config.hidden_size, seed=7)
    with torch.inference_mode():
        before = model.compute_logits(hidden)
    path = tmp_path / "choices.json"
    choices = KernelChoices(path)
    state = torch.random.get_rng_state()
    taken = cpu_onednn.attach(model, choices)
    assert torch.equal(torch.random.get_rng_state(), state)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert choices.source.startswith("5 timed now") and len(linears) == 9
    assert taken == sum(m.weight_packed is not None for m in linears)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), before, rtol=1e-4, atol=1e-4)
    choices.save()
    again, fresh = KernelChoices(path), load_model(tmp_path)
    assert cpu_onednn.attach(fresh, again) == taken
    assert again.source == f"cached in {path}"
    packed = [m.weight_packed is not None for m in fresh.modules() if isinstance(m, Linear)]
    assert packed == [m.weight_packed is not None for m in linears]


def test_nothing_is_packed_where_the_copies_would_crowd_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies needing more than half of the available memory: MKL for every layer."""
    build_checkpoint(tmp_path, CONFIGS["llama"]())
    model = load_model(tmp_path)
    monkeypatch.setattr(cpu_onednn, "_packed_is_faster", lambda module, packed, choices: True)
    monkeypatch.setattr(cpu_onednn, "_available_memory", lambda: 2**10)
    choices = KernelChoices(tmp_path / "choices.json")
    assert cpu_onednn.attach(model, choices) == 0
    assert all(m.weight_packed is None for m in model.modules() if isinstance(m, Linear))
    monkeypatch.setattr(cpu_onednn, "_available_memory", lambda: 2**40)
    assert cpu_onednn.attach(model, choices) == 9


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_window"])
def test_greedy_decode_through_packed_weights_matches_generate(arch: str, tmp_path: Path) -> None:
    """Every Linear packed (whatever this CPU's timing would pick): prompts prefilled in one
    batch, then decoded together, give transformers' greedy tokens."""
    build_checkpoint(tmp_path, CONFIGS[arch]())
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = load_model(tmp_path)
    for module in model.modules():
        if isinstance(module, Linear):
            module.weight_packed = pack_weight(module.weight.detach())
    prompts = [random_prompt(n, seed=20 + n) for n in (11, 3, 26)]
    num_new = 24
    for prompt, generated in zip(prompts, paged_greedy(model, prompts, num_new), strict=True):
        assert generated == hf_greedy(hf_model, prompt, num_new)

"""LMHead: the second weight layout gives the products of the first."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv.model.lm_head import LMHead
from pagedkv.model.tuning import KernelChoices


def _head(dtype: torch.dtype) -> LMHead:
    head = LMHead(48, 1000).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(48, 1000, generator=torch.Generator().manual_seed(0)))
    head.prepare()
    return head


@pytest.mark.parametrize("batches_by_vocab", [False, True])
@pytest.mark.parametrize("num_rows", [1, 2, 7, 64])
def test_every_batch_size_gets_the_products_of_the_loaded_weight(
    num_rows: int, batches_by_vocab: bool
) -> None:
    """Whichever layout ``choose_batch_layout`` timed faster for batches."""
    head = _head(torch.float32)
    head.batches_by_vocab = batches_by_vocab
    x = torch.randn(num_rows, 48, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(head(x), x.double().mm(head.weight.double()).float())


def test_the_layouts_are_timed_once_per_machine_without_the_global_generator(tmp_path) -> None:
    """Both choices are timed once, saved, and read back by the next head of the same shape;
    nothing draws from the global generator. Without the copy (bf16) nothing is timed."""
    from pagedkv.model.cpu_gemv import load_cpu_gemv

    state = torch.random.get_rng_state()
    path = tmp_path / "choices.json"
    for start in range(2):
        choices = KernelChoices(path)
        head = _head(torch.float32)
        head.cpu_gemv = load_cpu_gemv()
        head.choose_batch_layout(choices)
        head.choose_gemv_layout(choices)
        choices.save()
        saved = json.loads(path.read_text())["choices"]
        assert saved == {
            "LM head batches by vocab over by hidden: 48x1000": head.batches_by_vocab,
            "LM head one row by vocab over by hidden: 48x1000": head.gemv_by_vocab,
        }
        timed, cached = f"2 timed now; saved to {path}", f"cached in {path}"
        assert choices.source == (timed if start == 0 else cached)
    assert torch.equal(torch.random.get_rng_state(), state)
    bf16 = _head(torch.bfloat16)
    bf16.choose_batch_layout(KernelChoices(tmp_path / "bf16.json"))
    assert bf16.batches_by_vocab is False and bf16.weight_by_vocab is None


def test_the_vocab_major_copy_is_made_only_for_fp32_on_cpu() -> None:
    fp32 = _head(torch.float32)
    assert fp32.weight_by_vocab is not None
    assert torch.equal(fp32.weight_by_vocab, fp32.weight.t())
    assert fp32.weight_by_vocab.is_contiguous()
    assert _head(torch.bfloat16).weight_by_vocab is None
    assert "weight_by_vocab" not in fp32.state_dict()  # never saved, never loaded


@pytest.mark.parametrize("batches_by_vocab", [False, True])
def test_the_copy_is_freed_only_when_nothing_reads_it(batches_by_vocab: bool) -> None:
    """Without the one-row GEMV, only batches could read the ``[vocab, hidden]`` copy."""
    from pagedkv.model.cpu_gemv import load_cpu_gemv

    head = _head(torch.float32)
    head.batches_by_vocab = batches_by_vocab
    head.release_unused_copy()
    assert (head.weight_by_vocab is not None) == batches_by_vocab
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(head(x), x.double().mm(head.weight.double()).float())
    attached = _head(torch.float32)
    attached.batches_by_vocab = False
    attached.cpu_gemv = load_cpu_gemv()
    attached.release_unused_copy()
    assert attached.weight_by_vocab is not None  # the GEMV streams it for one row


@pytest.mark.parametrize("gemv_by_vocab", [True, False])
@pytest.mark.parametrize("packed", [True, False])
def test_the_copy_is_kept_exactly_while_one_rows_or_batches_read_it(
    gemv_by_vocab: bool, packed: bool
) -> None:
    """Batches read it when MKL timed it faster and no oneDNN copy is packed; one rows when
    the GEMV timed it faster. Every row count still gets the weight's products."""
    from pagedkv.model.cpu_gemv import load_cpu_gemv
    from pagedkv.model.cpu_onednn import onednn_available, pack_weight

    if packed and not onednn_available():
        pytest.skip("torch built without oneDNN")
    head = _head(torch.float32)
    head.batches_by_vocab = True
    head.cpu_gemv = load_cpu_gemv()
    head.gemv_by_vocab = gemv_by_vocab
    head.weight_packed = pack_weight(head.weight.detach()) if packed else None
    head.release_unused_copy()
    assert (head.weight_by_vocab is not None) == (gemv_by_vocab or not packed)
    for num_rows in (1, 6):
        x = torch.randn(num_rows, 48, generator=torch.Generator().manual_seed(num_rows))
        torch.testing.assert_close(head(x), x.double().mm(head.weight.double()).float())

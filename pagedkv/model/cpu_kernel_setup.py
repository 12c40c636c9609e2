"""An fp32 model on CPU, made ready to run: the compiled kernels attached (unless eager), and
each choice between equivalent implementations made once per machine (``tuning.KernelChoices``).

Those choices (oneDNN or MKL per weight shape, the LM head's layout for batches and for one
row) agree up to fp32 rounding only, so each start applies the same ones: read from the file,
or timed and saved there by the first start on this machine. One INFO line says what was chosen
and where it came from.
"""

from __future__ import annotations

import logging

from pagedkv.model.cpu_decode_layer import attach as attach_decode_layer
from pagedkv.model.cpu_gemv import attach as attach_gemv
from pagedkv.model.cpu_gemv import load_cpu_gemv
from pagedkv.model.cpu_layer_ops import attach as attach_layer_ops
from pagedkv.model.cpu_layer_ops import load_cpu_layer_ops
from pagedkv.model.cpu_onednn import attach as attach_onednn
from pagedkv.model.linear import Linear
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.lm_head import LMHead
from pagedkv.model.tuning import KernelChoices

logger = logging.getLogger(__name__)


def attach_cpu_kernels(model: LlamaForCausalLM, compiled: bool, retune: bool) -> None:
    """Make ``model`` (fp32 on CPU, weights loaded) ready: with ``compiled``, the compiled ops,
    GEMV, one-call decode layers and oneDNN's packed weights; in any case the LM head's layouts.
    ``retune``: time every choice again (``--retune-kernels``).

    A tensor-parallel shard gets the same kernels, on the shard's shapes (the choices are keyed
    by shape); its one-call decode layers run the group's all-reduces from C, so they come only
    with the shared-memory collectives (a gloo-only group runs its layers module by module)."""
    choices = KernelChoices.for_this_machine(retune)
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    for head in heads:
        head.choose_batch_layout(choices)
    if compiled:
        ops = load_cpu_layer_ops()
        if ops is not None:
            attach_layer_ops(model, ops)
        gemv = load_cpu_gemv()
        if gemv is not None:
            attach_gemv(model, gemv)
            for head in heads:
                head.choose_gemv_layout(choices)
        attach_decode_layer(model)
        attach_onednn(model, choices)
    for head in heads:
        head.release_unused_copy()
    choices.save()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    packed = [m for m in linears if m.weight_packed is not None]
    extra_mb = sum(m.weight.numel() * m.weight.element_size() for m in packed) / 2**20
    logger.info(
        "GEMM choice: oneDNN for %d of %d linear layers (%.1f MB more), LM head %s (%s)",
        len(packed), len(linears), extra_mb, "; ".join(h.describe_layouts() for h in heads),
        choices.source,
    )  # fmt: skip

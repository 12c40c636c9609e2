from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
)

from pagedkv.attention import AttentionMetadata, ForwardContext, get_attention_backend
from pagedkv.model.config import KVCacheLayerSpec, ModelConfig
from pagedkv.model.llama import LlamaForCausalLM
from pagedkv.model.loader import load_model
from pagedkv.model.qwen2 import Qwen2ForCausalLM
from pagedkv.model.registry import get_model_class
from tests.tiny_models import CONFIGS, TINY, WINDOW, build_checkpoint, random_prompt

NULL_BLOCK = 0


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, LlamaForCausalLM]:
    directory = tmp_path_factory.mktemp(request.param)
    build_checkpoint(directory, CONFIGS[request.param]())
    hf_model = AutoModelForCausalLM.from_pretrained(directory).eval()
    return hf_model, load_model(directory)


class PagedRunner:
    """Test-side stand-in for the ModelRunner.

    Every layer has its own cache; requests get shuffled physical blocks. For sliding-window
    layers, blocks that left every query's window are replaced by the null block, which is
    filled with NaN to prove it is never read.
    """

    def __init__(self, model: LlamaForCausalLM, block_size: int = 16, num_blocks: int = 64) -> None:
        self.model = model
        self.block_size = block_size
        self.specs = model.config.kv_cache_layer_specs()
        self.kv_caches = [
            torch.zeros(
                2, num_blocks, block_size, s.num_kv_heads, s.head_size, dtype=model.config.dtype
            )
            for s in self.specs
        ]
        for kv_cache in self.kv_caches:
            kv_cache[:, NULL_BLOCK] = float("nan")
        self.free_blocks = list(np.random.default_rng(0).permutation(np.arange(1, num_blocks)))
        self.blocks: list[list[int]] = []
        self.backend = get_attention_backend("torch")

    def step(
        self, chunks: list[tuple[int, list[int]]], kv_connector: object | None = None
    ) -> tuple[torch.Tensor, np.ndarray]:
        """chunks: (num_computed_tokens, new token ids) per request, request i = row i.

        Returns the hidden states and the flat row of each request's last token.
        """
        while len(self.blocks) < len(chunks):
            self.blocks.append([])
        bs = self.block_size
        positions, slots = [], []
        for blocks, (computed, new_ids) in zip(self.blocks, chunks, strict=False):
            seq_len = computed + len(new_ids)
            while len(blocks) < math.ceil(seq_len / bs):
                blocks.append(self.free_blocks.pop())
            pos = np.arange(computed, seq_len)
            positions.append(pos)
            slots.append(np.asarray(blocks)[pos // bs] * bs + pos % bs)
        query_start_loc = np.concatenate([[0], np.cumsum([len(ids) for _, ids in chunks])])
        seq_lens = np.array([c + len(ids) for c, ids in chunks])
        width = max(len(b) for b in self.blocks) + 1
        by_window: dict[int | None, AttentionMetadata] = {}
        for window in {s.sliding_window for s in self.specs}:
            table = np.zeros((len(chunks), width), dtype=np.int32)
            for row, ((computed, _), blocks) in enumerate(zip(chunks, self.blocks, strict=False)):
                table[row, : len(blocks)] = blocks
                if window is not None:
                    table[row, : max(computed - window + 1, 0) // bs] = NULL_BLOCK
            by_window[window] = AttentionMetadata.from_numpy(
                query_start_loc, seq_lens, table, np.concatenate(slots), bs, window
            )
        ctx = ForwardContext(
            kv_caches=self.kv_caches,
            attn_metadata=[by_window[s.sliding_window] for s in self.specs],
            backend=self.backend,
            kv_connector=kv_connector,
        )
        input_ids = torch.tensor([t for _, ids in chunks for t in ids], dtype=torch.int64)
        with torch.inference_mode():
            hidden = self.model(input_ids, torch.from_numpy(np.concatenate(positions)), ctx)
        return hidden, query_start_loc[1:] - 1


def paged_greedy(
    model: LlamaForCausalLM, prompts: list[list[int]], num_new: int
) -> list[list[int]]:
    """Prefill every prompt in one step, then decode one token per request per step."""
    runner = PagedRunner(model)
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    for _ in range(num_new):
        hidden, last_rows = runner.step([(c, s[c:]) for c, s in zip(computed, seqs, strict=True)])
        with torch.inference_mode():
            next_ids = model.compute_logits(hidden[torch.from_numpy(last_rows)]).argmax(-1)
        for i, seq in enumerate(seqs):
            computed[i] = len(seq)
            seq.append(int(next_ids[i]))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def hf_greedy(hf_model: PreTrainedModel, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``num_new`` tokens."""
    with torch.inference_mode():
        generated = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
        )
    return generated[0, len(prompt) :].tolist()


def hf_logits(hf_model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_prompt_logits_match_transformers(
    model_pair: tuple[PreTrainedModel, LlamaForCausalLM],
) -> None:
    hf_model, model = model_pair
    prompts = [random_prompt(n, seed=n) for n in (40, 5, 17)]
    hidden, _ = PagedRunner(model).step([(0, p) for p in prompts])
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    expected = [hf_logits(hf_model, p) for p in prompts]
    torch.testing.assert_close(logits, torch.cat(expected), atol=1e-4, rtol=1e-4)
    hidden, _ = PagedRunner(model).step([(0, prompts[0])])
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), expected[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_bf16_prompt_logits_equal_transformers(arch: str, tmp_path: Path) -> None:
    """In bf16 every op rounds as transformers' does (RMSNorm included: normalise in fp32,
    round, then scale), so prompt logits are bit-equal, not merely close."""
    build_checkpoint(tmp_path, CONFIGS[arch]())
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    model = load_model(tmp_path, dtype=torch.bfloat16)
    prompts = [random_prompt(n, seed=n) for n in (40, 5, 17)]
    hidden, _ = PagedRunner(model).step([(0, p) for p in prompts])
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    assert torch.equal(logits, torch.cat([hf_logits(hf_model, p) for p in prompts]))


def test_chunked_prefill_after_prefix_matches_transformers(
    model_pair: tuple[PreTrainedModel, LlamaForCausalLM],
) -> None:
    hf_model, model = model_pair
    prompt, other = random_prompt(45, seed=1), random_prompt(30, seed=2)
    runner = PagedRunner(model)
    runner.step([(0, prompt[:21]), (0, other[:29])])
    hidden, _ = runner.step([(21, prompt[21:]), (29, other[29:])])
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    expected = torch.cat([hf_logits(hf_model, prompt)[21:], hf_logits(hf_model, other)[29:]])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_generate(
    model_pair: tuple[PreTrainedModel, LlamaForCausalLM],
) -> None:
    hf_model, model = model_pair
    num_new = 24
    prompts = [random_prompt(n, seed=10 + n) for n in (11, 3, 26)]
    ours = paged_greedy(model, prompts, num_new)
    for prompt, generated in zip(prompts, ours, strict=True):
        assert generated == hf_greedy(hf_model, prompt, num_new)
    assert paged_greedy(model, prompts[:1], num_new) == ours[:1]


def test_kv_cache_layer_specs() -> None:
    hybrid = ModelConfig.from_hf_config(CONFIGS["qwen2_hybrid"]())
    assert hybrid.kv_cache_layer_specs() == [
        KVCacheLayerSpec(2, 16, None),
        KVCacheLayerSpec(2, 16, WINDOW),
        KVCacheLayerSpec(2, 16, WINDOW),
    ]
    mistral = ModelConfig.from_hf_config(CONFIGS["mistral_window"]())
    assert [s.sliding_window for s in mistral.kv_cache_layer_specs()] == [WINDOW, WINDOW]
    assert ModelConfig.from_hf_config(CONFIGS["llama_linear_head_dim"]()).head_dim == 24
    qwen2_full = ModelConfig.from_hf_config(Qwen2Config(**TINY, num_hidden_layers=2))
    assert qwen2_full.sliding_windows == (None, None)
    # layer_types are honoured whatever the architecture (Ministral-style Mistral checkpoints).
    alternating = MistralConfig(
        **TINY,
        num_hidden_layers=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    assert ModelConfig.from_hf_config(alternating).sliding_windows == (WINDOW, None)


def test_projection_biases() -> None:
    with torch.device("meta"):
        qwen2 = Qwen2ForCausalLM(ModelConfig.from_hf_config(CONFIGS["qwen2"]()))
        llama = LlamaForCausalLM(ModelConfig.from_hf_config(CONFIGS["llama_linear_head_dim"]()))
        mistral = LlamaForCausalLM(ModelConfig.from_hf_config(CONFIGS["mistral_window"]()))
    biases = [
        (
            m.model.layers[0].self_attn.qkv_proj.bias is not None,
            m.model.layers[0].self_attn.o_proj.bias is not None,
        )
        for m in (qwen2, llama, mistral)
    ]
    assert biases == [(True, False), (True, True), (False, False)]


class RecordingConnector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def wait_for_layer_load(self, layer_idx: int) -> None:
        self.calls.append(("wait", layer_idx))

    def save_kv_layer(
        self, layer_idx: int, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        assert not kv_cache[:, 1:].eq(0).all(), "save_kv_layer must see this step's keys"
        self.calls.append(("save", layer_idx))


def test_kv_connector_hooks_run_per_layer(tmp_path: Path) -> None:
    build_checkpoint(tmp_path, CONFIGS["llama"]())
    model = load_model(tmp_path)
    connector = RecordingConnector()
    PagedRunner(model).step([(0, random_prompt(9, seed=3))], kv_connector=connector)
    assert connector.calls == [("wait", 0), ("save", 0), ("wait", 1), ("save", 1)]


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    build_checkpoint(tmp_path / "one", CONFIGS["qwen2"]())
    build_checkpoint(tmp_path / "sharded", CONFIGS["qwen2"](), max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one, sharded = load_model(tmp_path / "one"), load_model(tmp_path / "sharded")
    for (name, a), (_, b) in zip(
        one.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_bf16_load_smoke(tmp_path: Path) -> None:
    config = CONFIGS["llama_tied_llama3"]()
    build_checkpoint(tmp_path, config)
    reference = load_model(tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # tied: the head is the embedding, stored input-major
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight.t())
    prompt = random_prompt(20, seed=4)
    hidden, last = PagedRunner(model).step([(0, prompt)])
    ref_hidden, _ = PagedRunner(reference).step([(0, prompt)])
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        ref_logits = reference.compute_logits(ref_hidden)
    assert logits.dtype == torch.float32 and logits.isfinite().all()
    assert (logits - ref_logits).abs().max() < 0.05 * ref_logits.abs().max()

    bf16_dir = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).save_pretrained(bf16_dir)
    assert load_model(bf16_dir).config.dtype == torch.bfloat16


def test_unsupported_architecture(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
    assert get_model_class(["MistralForCausalLM"]) is LlamaForCausalLM
    build_checkpoint(tmp_path, CONFIGS["llama"]())
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["FalconForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture FalconForCausalLM; supported: "):
        load_model(tmp_path)


def test_load_weights_rejects_bad_checkpoints(tmp_path: Path) -> None:
    build_checkpoint(tmp_path, CONFIGS["llama"]())
    model = load_model(tmp_path)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), expected \(64,\)"):
        model.load_weights([("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match=r"\(128, 64\), expected \(64, 64\)"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.ones(128, 64))])
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.9.mlp.up_proj.weight'"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.ones(128, 64))])
    with pytest.raises(
        ValueError, match=r"missing from checkpoint: .*layers\.0\.self_attn\.qkv_proj"
    ):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.ones(64, 64))])

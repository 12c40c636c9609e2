"""A checkpoint's generation defaults (``generation_config.json``): its EOS and sampling knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

#: ``generation_config.json`` keys that become SamplingParams defaults, as in vLLM
#: (``max_new_tokens`` becomes ``max_tokens``).
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    #: The primary EOS: the first of the checkpoint's EOS ids.
    eos_token_id: int | None = None
    #: Every EOS id the checkpoint lists (``eos_token_id`` may be a list), the primary first.
    eos_token_ids: tuple[int, ...] = ()
    #: SamplingParams fields the checkpoint recommends: what a request that does not set them
    #: samples with (vLLM's ``--generation-config auto``). Empty under ``vllm``.
    sampling: dict[str, float | int] = field(default_factory=dict)

    @classmethod
    def from_model_dir(cls, model_path: Path, source: str = "auto") -> GenerationDefaults:
        """EOS ids from ``generation_config.json`` (what ``transformers.generate`` uses),
        falling back to ``config.json``; the first is the primary one. Sampling defaults
        from the model directory (``auto``), from a directory's ``generation_config.json``
        (a path), or none (``vllm``: vLLM's own defaults). As in vLLM, the sampling keys
        apply whether or not the file sets ``do_sample``."""
        config = json.loads((model_path / "config.json").read_text())
        gen = _read(model_path / "generation_config.json")
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        eos_kwargs = dict(eos_token_id=eos_ids[0] if eos_ids else None, eos_token_ids=eos_ids)
        if source == "vllm":
            return cls(**eos_kwargs)
        if source != "auto":
            path = Path(source)
            if not (path / "generation_config.json").is_file():
                raise ValueError(
                    f"generation_config must be 'auto', 'vllm' or a directory holding a "
                    f"generation_config.json, got {source!r}"
                )
            gen = _read(path / "generation_config.json")
        sampling = {
            name: gen[key]
            for key, name in _SAMPLING_KEYS.items()
            if isinstance(gen.get(key), int | float) and not isinstance(gen.get(key), bool)
        }
        return cls(**eos_kwargs, sampling=sampling)


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}

"""A checkpoint's generation defaults (``generation_config.json``): its EOS and sampling knobs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_id: int | None = None
    #: Sampling the checkpoint recommends; ``temperature=0`` (greedy) when it sets no
    #: ``do_sample``, as ``transformers.generate`` does.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_model_dir(cls, model_path: Path) -> GenerationDefaults:
        """``generation_config.json`` (what ``transformers.generate`` uses), falling back to
        ``config.json``'s ``eos_token_id``. The first id stands for a list of EOS ids."""
        config = json.loads((model_path / "config.json").read_text())
        gen: dict = {}
        path = model_path / "generation_config.json"
        if path.is_file():
            gen = json.loads(path.read_text())
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if not gen.get("do_sample"):
            return cls(eos_token_id=eos)
        return cls(
            eos_token_id=eos,
            temperature=float(gen.get("temperature", 1.0)),
            top_p=float(gen.get("top_p", 1.0)),
            top_k=int(gen.get("top_k") or 0),
        )

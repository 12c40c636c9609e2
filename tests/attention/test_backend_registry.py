"""The backend registry without triton installed (needs no triton itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedkv.attention import available_attention_backends

# A fresh interpreter where `import triton` fails, as on a CPU-only install.
_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None

import torch
import pagedkv
from pagedkv.attention import get_attention_backend

assert get_attention_backend("torch").name == "torch"
try:
    get_attention_backend("triton")
except ImportError as e:
    print(e)
assert not any(name.startswith("triton") for name in sys.modules if sys.modules[name])
"""


def test_triton_is_registered() -> None:
    assert available_attention_backends() == ["torch", "triton"]


def test_cpu_install_works_and_triton_backend_says_what_to_install() -> None:
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == (
        "attention backend 'triton' needs the 'triton' package: pip install 'pagedkv[gpu]'"
    )

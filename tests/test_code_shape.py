"""The shape of the code, as contracts: the floors of ``docs/architecture.md`` (imports only
point down, no import loop at any depth: ``[tool.importlinter]`` in pyproject.toml, checked by
import-linter), no module over 400 lines and no function over 60 (the Triton kernel aside)."""

from __future__ import annotations

import ast
from pathlib import Path

from importlinter import configuration
from importlinter.application.use_cases import lint_imports

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "pagedkv").rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
#: A kernel is one long function by nature: split, it would stop being one kernel.
LONG_FUNCTIONS_ALLOWED = {"pagedkv/attention/triton_paged_attention.py"}


def test_import_contracts_kept():
    """On failure the report above names each import that breaks a floor or closes a loop."""
    configuration.configure()  # what the ``lint-imports`` command sets up before it lints
    assert lint_imports(str(ROOT / "pyproject.toml"), cache_dir=None, no_logo=True)


def test_no_module_over_400_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in MODULES
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these by owner: {long}"


def test_no_function_over_60_lines():
    long = []
    for path in MODULES:
        name = str(path.relative_to(ROOT))
        if name in LONG_FUNCTIONS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and n > MAX_FUNCTION_LINES:
                long.append(f"{name}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "split these by named steps:\n" + "\n".join(long)

"""No input reaches pickle, marshal, eval/exec or torch.load anywhere in ``pagedkv/``.

An AST scan, not a grep: comments and strings can't fool it, and aliases are resolved
(``import pickle as p; p.loads``, ``from torch import load``, ``getattr(x, "eval")``). Flagged:

- importing a module that unpickles or runs code from data (pickle and its kin, marshal,
  shelve, dill, cloudpickle, joblib, jsonpickle, multiprocessing.connection, torch.package);
- the builtins eval, exec, compile and __import__;
- torch.load (and torch.jit / torch.serialization loads), pandas.read_pickle, yaml.load and
  its unsafe kin, numpy.load with allow_pickle=True;
- ZMQ's pickling socket methods (send_pyobj / recv_pyobj / *_serialized);
- torch.distributed's object collectives (pickle underneath) and TCPStore (pickled data on a
  port that binds every interface: CVE-2025-47277).

Nothing is allowlisted. (``module.eval()`` on a torch module is a method, not the builtin.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedkv"

FORBIDDEN_MODULES = (
    "pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal", "jsonpickle",
    "joblib", "multiprocessing.connection", "torch.package",
)  # fmt: skip
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_NAMES = {
    "torch.load", "torch.jit.load", "torch.serialization.load", "pandas.read_pickle",
    "yaml.load", "yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all",
    "torch.distributed.TCPStore", "torch.distributed.send_object_list",
    "torch.distributed.recv_object_list", "torch.distributed.broadcast_object_list",
    "torch.distributed.all_gather_object", "torch.distributed.gather_object",
    "torch.distributed.scatter_object_list",
} | {f"builtins.{name}" for name in FORBIDDEN_BUILTINS}  # fmt: skip
#: Methods that unpickle whatever object they are called on (pyzmq sockets).
FORBIDDEN_METHODS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}


def _is_forbidden_module(name: str) -> bool:
    return any(name == m or name.startswith(f"{m}.") for m in FORBIDDEN_MODULES)


class _Scanner(ast.NodeVisitor):
    def __init__(self, tree: ast.AST) -> None:
        self.problems: list[tuple[int, str]] = []
        self.aliases: dict[str, str] = {}  # local name -> dotted origin
        for node in ast.walk(tree):  # imports anywhere in the file (also inside functions)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def flag(self, node: ast.AST, what: str) -> None:
        self.problems.append((getattr(node, "lineno", 0), what))

    def dotted(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _is_forbidden_module(alias.name):
                self.flag(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            full = f"{module}.{alias.name}"
            forbidden = _is_forbidden_module(module) or _is_forbidden_module(full)
            if forbidden or full in FORBIDDEN_NAMES:
                self.flag(node, f"from {module} import {alias.name}")

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            name = self.aliases.get(node.id, node.id)
            if node.id in FORBIDDEN_BUILTINS and node.id not in self.aliases:
                self.flag(node, f"builtin {node.id}")
            elif name in FORBIDDEN_NAMES or _is_forbidden_module(name):
                self.flag(node, name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self.dotted(node)
        if name is not None and (name in FORBIDDEN_NAMES or _is_forbidden_module(name)):
            self.flag(node, name)
        elif node.attr in FORBIDDEN_METHODS:
            self.flag(node, f".{node.attr}")
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        args = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if name in ("getattr", "builtins.getattr") and len(node.args) >= 2:
            attr = node.args[1]
            if (
                isinstance(attr, ast.Constant)
                and attr.value in FORBIDDEN_BUILTINS | FORBIDDEN_METHODS
            ):
                self.flag(node, f"getattr(..., {attr.value!r})")
        if name in ("importlib.import_module", "__import__") and any(
            isinstance(a, str) and _is_forbidden_module(a) for a in args
        ):
            self.flag(node, f"{name}({args[0]!r})")
        if name == "numpy.load" and any(
            k.arg == "allow_pickle"
            and not (isinstance(k.value, ast.Constant) and not k.value.value)
            for k in node.keywords
        ):
            self.flag(node, "numpy.load(allow_pickle=...)")
        self.generic_visit(node)


def scan(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    scanner = _Scanner(tree)
    scanner.visit(tree)
    return sorted(scanner.problems)


def test_the_scanner_catches_each_form_and_ignores_comments_strings_and_methods() -> None:
    source = """
import pickle                                   # 2
import marshal as m                             # 3
from torch import load                          # 4
import torch
import torch.distributed as dist
import numpy as np
import zmq, importlib, builtins
x = torch.load("f")                             # 9
dist.broadcast_object_list([x])                 # 10
s = dist.TCPStore("0.0.0.0", 1, 2, True)        # 11
eval("1")                                       # 12
exec("pass")                                    # 13
getattr(builtins, "eval")("1")                  # 14
zmq.Context().socket(zmq.PAIR).recv_pyobj()     # 15
importlib.import_module("pickle")               # 16
np.load("f", allow_pickle=True)                 # 17
f = torch.load                                  # 18
# pickle.loads(data) in a comment; torch.load in a comment
"eval(x) and pickle.loads in a string"
model = torch.nn.Linear(1, 1).eval()            # a method: fine
np.load("f")                                    # safe default: fine
np.load("f", allow_pickle=False)                # fine
"""
    lines = [line for line, _ in scan(source)]
    assert lines == [2, 3, 4, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], scan(source)


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_scanned_whole() -> None:
    files = package_files()
    assert len(files) > 80 and PACKAGE / "kv_transfer" / "p2p" / "protocol.py" in files


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_unsafe_deserialization_or_code_execution(path: Path) -> None:
    assert scan(path.read_text()) == [], f"{path.relative_to(PACKAGE.parent)}"

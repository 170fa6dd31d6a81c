"""Every Triton kernel reads only what a GPU compile accepts: its arguments, its own
locals, `tl`/`triton`/`math`, other jitted functions and `tl.constexpr(...)` globals. The
interpreter the CPU tests run under accepts any global, so a kernel that reads a plain
module constant passes every CPU test and fails on its first GPU launch (the top-p kernel
did). This check is static, so it covers the kernels no CPU machine can compile."""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest
from triton.runtime import JITFunction

KERNELS = sorted((Path(__file__).parent.parent / "kernels").glob("*.py"))
ALLOWED_MODULES = {"tl", "triton", "math", "libdevice"}


def is_jit(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def constexpr_globals(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and "constexpr(" in ast.unparse(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def bound_names(fn: ast.FunctionDef) -> set[str]:
    args = fn.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def imported_kernels(tree: ast.Module) -> set[str]:
    """Names imported from another kernels module that are jitted there."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kernels."):
            module = importlib.import_module(node.module)
            names |= {alias.asname or alias.name for alias in node.names
                      if isinstance(getattr(module, alias.name), JITFunction)}
    return names


def stray_globals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    jitted = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and is_jit(n)}
    allowed = (jitted | imported_kernels(tree) | constexpr_globals(tree) | ALLOWED_MODULES
               | set(dir(builtins)))
    strays = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in jitted):
        local = bound_names(fn)
        for node in ast.walk(fn):
            if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                    and node.id not in local and node.id not in allowed):
                strays.append(f"{path.name}:{node.lineno} {fn.name} reads {node.id}")
    return strays


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_kernels_read_no_plain_globals(path: Path) -> None:
    assert stray_globals(path) == []


def test_the_check_finds_a_plain_global(tmp_path: Path) -> None:
    source = tmp_path / "k.py"
    source.write_text("import triton\nimport triton.language as tl\nLIMIT = 3\n"
                      "OK = tl.constexpr(4)\n@triton.jit\ndef k(x_ptr, N: tl.constexpr):\n"
                      "    y = tl.load(x_ptr) + OK\n    tl.store(x_ptr, y * LIMIT)\n")
    assert stray_globals(source) == ["k.py:8 k reads LIMIT"]

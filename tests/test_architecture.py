"""The layout is the architecture: a service package imports only common/ and kernels/
(what two services share lives in common/), common/ and kernels/ never import services/,
and the gateway and tokenizer shells do not import torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(package: Path, allowed: tuple[str, ...]) -> list[str]:
    """`file: module` for each import of services/ outside `allowed` prefixes."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for name in sorted(imported_modules(path)):
            top = name.split(".")
            if top[0] == "services" and not any(name == a or name.startswith(a + ".")
                                                for a in allowed):
                found.append(f"{path.relative_to(package.parent)}: {name}")
    return found


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service(service):
    assert violations(ROOT / "services" / service, (f"services.{service}",)) == []


@pytest.mark.parametrize("package", ["common", "kernels"])
def test_common_and_kernels_import_no_service(package):
    assert violations(ROOT / package, ()) == []


def test_the_check_sees_a_crossing(tmp_path):
    """The walk finds imports inside functions and `from services import x` forms."""
    bad = tmp_path / "tokenizer"
    bad.mkdir()
    (bad / "core.py").write_text("def f():\n    from services.scheduler import core\n"
                                 "import services.worker.shell as w\n")
    assert len(violations(bad, ("services.tokenizer",))) == 3


@pytest.mark.parametrize("modules", [
    ["services.tokenizer.shell"], ["services.gateway.shell"],
    ["services.cli", "services.launcher", "services.queues"]])
def test_light_processes_import_no_torch(modules):
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "heavy = sorted(m for m in ('torch', 'triton') if m in sys.modules)\n"
            + "print(','.join(heavy))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"{modules} imported {result.stdout.strip()}"

"""The layout is the architecture:

- a service package imports only common/, kernels/ and itself (what two services share
  lives in common/);
- common/ and kernels/ import no service and no tool;
- the tools (benchmarks/) sit above the services: nothing in services/, common/ or
  kernels/ imports them, and they reach the services only through the public entry points
  named in TOOL_ENTRY_POINTS;
- relative imports are resolved and checked like absolute ones;
- the gateway and tokenizer shells, the CLI and the launcher do not import torch, and
  the stages that only tokenize (and the scheduler) load the model's config and tokenizer
  without it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("benchmarks", "common", "kernels", "services", "tests")  # our top-level packages
SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")
# What a tool may import from services/: a name here, and names imported from it, but no
# module below it (`from services.gateway import Choice`, not services.gateway.responses).
TOOL_ENTRY_POINTS = (
    "services",                  # LLM, SamplingParams, LoRARequest
    "services.offline.engine",   # Engine: the cores in one process, stepped by the caller
    "services.offline.llm",      # LLM
    "services.launcher",         # child_specs, fresh_metrics_dir: the served processes
    "services.demo",             # demo_model_path
    "services.gateway",          # services/gateway/public.py: Choice, parse_job,
                                 # validate_body, chunk_writer
    "services.worker",           # services/worker/__init__.py: load_weights,
                                 # to_device_together, decode_step_preparer
    "services.scheduler",        # services/scheduler/__init__.py: Scheduler, SchedulerConfig
    "services.detokenizer",      # services/detokenizer/__init__.py: batch_detokenizer
)
# Libraries every tool may use whole: the corridor, the kernels, the tools themselves.
TOOL_LIBRARIES = ("benchmarks", "common", "kernels")

Allowed = Callable[[str], bool]


def is_module(dotted: str) -> bool:
    """Whether `dotted` names a module or package of this repository (not a name in one)."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_of(path: Path, root: Path) -> str:
    """The dotted package a file belongs to (a package's __init__ is in the package)."""
    return ".".join(path.relative_to(root).parent.parts)


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The module `from ... import` reads, relative levels resolved against `package`."""
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise ValueError(f"relative import of level {node.level} above {package!r}")
    base = parts[:len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included), with
    relative imports made absolute; `from m import n` counts m.n when n is a module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, package)
            submodules = {f"{module}.{a.name}" for a in node.names
                          if is_module(f"{module}.{a.name}")}
            names.update(submodules or {module})
            if len(submodules) < len(node.names):  # some names are attributes of module
                names.add(module)
    return names


def violations(directory: Path, allowed: Allowed, root: Path = ROOT) -> list[str]:
    """`file: module` for each import of one of our packages that `allowed` refuses."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        for name in sorted(imported_modules(path, package_of(path, root))):
            if name.split(".")[0] in PROJECT and not allowed(name):
                found.append(f"{path.relative_to(root)}: {name}")
    return found


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def service_may_import(service: str) -> Allowed:
    return lambda name: within(name, ("common", "kernels", f"services.{service}"))


def tool_may_import(name: str) -> bool:
    return within(name, TOOL_LIBRARIES) or name in TOOL_ENTRY_POINTS


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_only_common_kernels_and_itself(service):
    assert violations(ROOT / "services" / service, service_may_import(service)) == []


@pytest.mark.parametrize("package", ["common", "kernels"])
def test_common_and_kernels_import_no_service_and_no_tool(package):
    assert violations(ROOT / package, lambda name: within(name, ("common", "kernels"))) == []


def test_nothing_below_the_tools_imports_them():
    """The CLI names the tools' modules as strings (imported when a command runs)."""
    for package in ("services", "common", "kernels"):
        assert violations(ROOT / package, lambda name: not within(name, ("benchmarks",))) == []


def test_the_tools_use_only_public_entry_points():
    assert violations(ROOT / "benchmarks", tool_may_import) == []


def test_every_entry_point_exists():
    assert [name for name in TOOL_ENTRY_POINTS if not is_module(name)] == []


def test_the_check_sees_a_crossing(tmp_path):
    """The walk finds imports inside functions, `from services import x` forms and
    relative imports, and lets a package's relative imports of itself pass."""
    bad = tmp_path / "services" / "tokenizer"
    bad.mkdir(parents=True)
    (bad / "core.py").write_text(
        "def f():\n    from services.scheduler import core\n"
        "import services.worker.shell as w\n"
        "from ..detokenizer import core as d\n"
        "from benchmarks.bench import serve\n"
        "from . import shell\n"
        "from .core import InputProcessor\n")
    assert violations(bad, service_may_import("tokenizer"), root=tmp_path) == [
        "services/tokenizer/core.py: benchmarks.bench.serve",
        "services/tokenizer/core.py: services.detokenizer.core",
        "services/tokenizer/core.py: services.scheduler.core",
        "services/tokenizer/core.py: services.worker.shell"]


def test_the_check_sees_a_tool_past_an_entry_point(tmp_path):
    tool = tmp_path / "benchmarks" / "bench"
    tool.mkdir(parents=True)
    (tool / "probe.py").write_text(
        "from services.gateway import Choice, core\n"
        "from services.worker.loader import load_weights\n"
        "from services.worker import load_weights\n"
        "from services.offline.engine import Engine\n"
        "from services.scheduler.core import Scheduler\n"
        "from .workloads import fixed_workload\n"
        "from common.config import EngineConfig\n")
    assert violations(tool, tool_may_import, root=tmp_path) == [
        "benchmarks/bench/probe.py: services.gateway.core",
        "benchmarks/bench/probe.py: services.scheduler.core",
        "benchmarks/bench/probe.py: services.worker.loader"]


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


# Each light stage's start-up, as its serve() runs it, on the demo GGUF: its imports, the
# model's config and tokenizer (and the tokenizer stage's input processor).
STAGE_STARTS = {
    "tokenizer": "import services.tokenizer.shell\n"
                 "from common.model_info import load_model_info\n"
                 "from services.tokenizer.core import InputProcessor\n"
                 "InputProcessor.from_info(load_model_info(engine, torch_free=True))\n",
    "gateway": "import services.gateway.shell\n"
               "from common.model_info import load_model_info\n"
               "load_model_info(engine, True)\n",
    "scheduler": "import services.scheduler.shell\n"
                 "from common.model_info import resolve_engine\n"
                 "resolve_engine(engine, torch_free=True)\n",
    "detokenizer": "import services.detokenizer.shell\n"
                   "from common.model_files import (load_tokenizer, resolve_model,\n"
                   "                                transformers_without_torch)\n"
                   "from services.detokenizer.core import Detokenizer\n"
                   "model_dir = resolve_model(engine.model, gguf_weights=False)\n"
                   "transformers_without_torch(model_dir)\n"
                   "Detokenizer(load_tokenizer(model_dir))\n",
    # the offline engine's child, through its main: input closed, so it ends at once
    "offline detokenizer": "import os\n"
                           "from common.model_files import resolve_model\n"
                           "from services.offline.detokenizer import main\n"
                           "read_end, write_end = os.pipe()\n"
                           "os.close(write_end)\n"
                           "model_dir = resolve_model(engine.model, gguf_weights=False)\n"
                           "assert main([str(model_dir), str(read_end), str(os.pipe()[1])]) == 0\n",
}


@pytest.fixture(scope="module")
def converted_demo() -> None:
    """The demo GGUF converted, here: transformers reads a GGUF file only with torch, and
    in a served stack the launcher converts it before any stage starts
    (common.model_info.resolve_engine runs there first). On a fresh machine the stage
    checks below would otherwise each convert it, with torch."""
    from common.model_files import resolve_model
    from services.demo import demo_model_path

    resolve_model(demo_model_path(), gguf_weights=False)


@pytest.mark.parametrize("stage", list(STAGE_STARTS))
def test_light_stages_load_the_model_without_torch(stage, converted_demo):
    """transformers' config module imports torch whenever it is installed (5-7 s of CPU
    per process); these stages have transformers run without it."""
    code = ("import sys\n"
            "from common.config import EngineConfig\n"
            "from services.demo import demo_model_path\n"
            "engine = EngineConfig(model=demo_model_path())\n"
            + STAGE_STARTS[stage]
            + "print('torch' if sys.modules.get('torch') is not None else '')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"the {stage} stage imported torch"
    assert "PyTorch was not found" not in result.stderr


def test_xgrammar_takes_torch_after_a_torch_free_start(converted_demo):
    """A structured request brings xgrammar, which needs torch, into the tokenizer stage
    after it started without: its bitmask is built with torch."""
    code = ("import sys\n"
            "from common.config import EngineConfig\n"
            "from common.model_info import load_model_info\n"
            "from common.structured_outputs import load_xgrammar\n"
            "from services.demo import demo_model_path\n"
            "info = load_model_info(EngineConfig(model=demo_model_path()), torch_free=True)\n"
            "assert sys.modules.get('torch', 0) is None, 'torch was not kept out'\n"
            "xgr = load_xgrammar()\n"
            "tokens = xgr.TokenizerInfo.from_huggingface(info.tokenizer,\n"
            "                                            vocab_size=info.vocab_size)\n"
            "compiled = xgr.GrammarCompiler(tokens).compile_json_schema('{\"type\": \"object\"}')\n"
            "mask = xgr.allocate_token_bitmask(1, tokens.vocab_size)\n"
            "xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask)\n"
            "print(type(mask).__module__)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch"


def test_torch_stays_for_vision_models_and_remote_code(tmp_path):
    """A vision-language model's image processor, and a model's own code, may need torch:
    transformers then keeps it; a text model's config and tokenizer go without."""
    text, vision = tmp_path / "text", tmp_path / "vision"
    for directory, config in ((text, {"model_type": "llama"}),
                              (vision, {"model_type": "qwen2_vl", "vision_config": {}})):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from common.model_files import transformers_without_torch\n"
            f"print(transformers_without_torch(Path({str(vision)!r})),\n"
            f"      transformers_without_torch(Path({str(text)!r}), trust_remote_code=True),\n"
            f"      transformers_without_torch(Path({str(text)!r})),\n"
            "      sys.modules['torch'])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True", "None"]


def test_a_tool_parser_plugin_may_import_torch_in_a_torch_free_gateway(tmp_path):
    """The gateway starts without torch; a --tool-parser-plugin that imports it still
    loads, and registers its parser."""
    plugin = tmp_path / "torch_parser.py"
    plugin.write_text("import torch\n"
                      "from services.gateway.tool_calls import register_tool_parser\n"
                      "@register_tool_parser('with-torch', markers=('<call>',))\n"
                      "def parse(text, tools):\n"
                      "    return torch.tensor([1]).item()\n")
    code = ("import sys\n"
            "sys.modules['torch'] = None  # as transformers_without_torch leaves it\n"
            "from services.gateway.tool_calls import TOOL_PARSERS, check_tool_parser\n"
            f"check_tool_parser('with-torch', {str(plugin)!r})\n"
            "print('with-torch' in TOOL_PARSERS, sys.modules['torch'].__name__)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "torch"]


def test_a_gguf_tokenizer_converts_before_a_stage_goes_without_torch(tmp_path):
    """--tokenizer given as a .gguf file, on a cold cache: resolve_engine (the launcher's
    first step, and each stage's) converts it with torch, and the stage then loads it
    without."""
    from services.demo import demo_model_path
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "model", "llama")
    code = ("import sys\n"
            "from common.config import EngineConfig\n"
            "from common.model_info import load_model_info\n"
            f"engine = EngineConfig(model={str(model)!r}, tokenizer={demo_model_path()!r})\n"
            "info = load_model_info(engine, torch_free=True)\n"
            "print(info.tokenizer('The capital of France')['input_ids'])\n")
    env = dict(os.environ, HEADRACE_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [504, 3575, 282, 4649]

"""A model headrace cannot run is refused from its config.json, after the overrides, before
anything starts: `headrace serve` and `headrace worker` exit 2 with one line naming what is
unsupported and what is, `LLM(...)` raises ValueError with that line. The supported names
are held equal to what the worker and the rotary kernel implement."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from common.config import EngineConfig
from common.model_info import resolve_engine
from common.model_support import (REFUSED_EXIT, SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES,
                                  UnsupportedModel, check_model_support)
from kernels.rotary import ROPE_TYPES
from services.worker.models import ARCHITECTURES
from tests.conftest import run_command
from tests.e2e_fixtures import tiny_serve_args
from tests.tiny_models import ARCHS, make_tiny_model, tiny_config

ARCH_LINE = f"unsupported architecture 'FooForCausalLM'; supported: " \
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
QUANT_LINE = "unsupported quantization 'bitsandbytes' (config.json quantization_config)"
UNKNOWN_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.5}
ROPE_LINE = f"unsupported RoPE type 'proportional'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
REFUSE_S = 30.0  # a refusal reads config.json only (about 3 s unloaded; CI shares 2 cores)


def test_the_supported_names_are_what_the_worker_and_the_kernel_implement():
    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURES)
    assert set(SUPPORTED_ROPE_TYPES) == set(ROPE_TYPES)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_tiny_model_passes(arch):
    check_model_support(tiny_config(arch))


@pytest.mark.parametrize("overrides,line", [
    (dict(architectures=["FooForCausalLM"]), ARCH_LINE),
    (dict(architectures=None), "config.json names no architecture"),
    (dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}), QUANT_LINE),
    (dict(rope_scaling=UNKNOWN_ROPE), ROPE_LINE),
    (dict(rope_scaling={"type": "mrope", "factor": 2.0}), "unsupported RoPE type 'mrope'"),
])
def test_a_config_is_refused_naming_what_is_unsupported(overrides, line):
    with pytest.raises(UnsupportedModel) as refused:
        check_model_support(tiny_config("qwen2", **overrides))
    assert str(refused.value).startswith(line)
    assert "\n" not in str(refused.value)


def test_per_layer_type_rope_parameters_are_each_checked():
    """transformers 5 configs may hold one set of RoPE parameters per layer type."""
    config = tiny_config("qwen2")
    config.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {**UNKNOWN_ROPE, "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModel, match=ROPE_LINE):
        check_model_support(config)
    config.rope_parameters["sliding_attention"] = {"rope_type": "default", "rope_theta": 1e4}
    check_model_support(config)


def config_dir(tmp_path: Path, **changes) -> Path:
    """A tiny model directory whose config.json has `changes` (None deletes a key)."""
    model_dir = make_tiny_model(tmp_path, "qwen2")
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return model_dir


def test_overrides_apply_before_the_check(tmp_path):
    foo = config_dir(tmp_path / "foo", architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedModel, match=ARCH_LINE):
        resolve_engine(EngineConfig(model=str(foo)))
    resolve_engine(EngineConfig(model=str(foo),
                                hf_overrides='{"architectures": ["Qwen2ForCausalLM"]}'))
    odd = config_dir(tmp_path / "odd", rope_scaling=UNKNOWN_ROPE)
    with pytest.raises(UnsupportedModel, match=ROPE_LINE):
        resolve_engine(EngineConfig(model=str(odd)))
    resolve_engine(EngineConfig(model=str(odd), rope_scaling='{"rope_type": "default"}'))
    fine = config_dir(tmp_path / "fine")
    with pytest.raises(UnsupportedModel, match=ROPE_LINE):
        resolve_engine(EngineConfig(model=str(fine), rope_scaling=json.dumps(UNKNOWN_ROPE)))


def test_llm_raises_the_line(tmp_path):
    from services.offline.llm import LLM

    with pytest.raises(ValueError) as refused:
        LLM(model=str(config_dir(tmp_path, architectures=["FooForCausalLM"])), device="cpu")
    assert str(refused.value) == ARCH_LINE


@pytest.mark.parametrize("changes,line", [
    (dict(architectures=["FooForCausalLM"]), ARCH_LINE),
    (dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}), QUANT_LINE),
    (dict(rope_scaling=UNKNOWN_ROPE), ROPE_LINE),
])
def test_serve_refuses_before_starting_anything(tmp_path, changes, line):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    done = run_command(*tiny_serve_args(config_dir(tmp_path, **changes), run_dir),
                       timeout=REFUSE_S)
    assert time.monotonic() - start < REFUSE_S
    assert done.returncode == REFUSED_EXIT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"headrace: {line}"), done.stderr
    assert not run_dir.exists()  # where the embedded Redis and the children would live


@pytest.mark.parametrize("command", ["worker", "generate"])
def test_worker_and_generate_refuse_before_starting(tmp_path, command):
    """No Redis is running (nor named): the worker refuses before it connects; generate
    before it loads anything."""
    model = str(config_dir(tmp_path, architectures=["FooForCausalLM"]))
    args = ([model, "--run-dir", str(tmp_path / "run")] if command == "worker"
            else ["--model", model, "--prompt", "hi"])
    done = run_command(command, *args, "--device", "cpu", timeout=REFUSE_S)
    assert done.returncode == REFUSED_EXIT, done.stderr
    assert done.stderr.strip().splitlines() == [f"headrace: {ARCH_LINE}"]

"""Model file resolution: directories, GGUF conversion (cached, converted once across
processes), hub ids offline, and reading config, tokenizer and generation config."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from common import model_files
from common.model_files import (ModelNotFound, load_generation_config, load_hf_config,
                                load_tokenizer, max_model_len_of, resolve_model)
from services.demo import demo_model_path
from tests.tiny_models import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
RESOLVE_SCRIPT = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
                  "from common.model_files import resolve_model; "
                  "print(resolve_model(sys.argv[1]))")


def run_python(code: str, *args: str, env: dict[str, str] | None = None
               ) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO_ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_import_pulls_in_neither_torch_nor_transformers():
    proc = run_python("import sys, common.model_files; "
                      "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "[]"


def test_a_directory_resolves_to_itself(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(str(tmp_path), "dummy") == tmp_path


def test_missing_gguf_and_non_gguf_files_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFound, match="GGUF file .* does not exist"):
        resolve_model(str(tmp_path / "absent.gguf"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00")
    with pytest.raises(ModelNotFound, match="is a file but not a .gguf file"):
        resolve_model(str(other))
    with pytest.raises(ModelNotFound, match="--load-format gguf needs a .gguf file"):
        resolve_model(str(tmp_path), "gguf")


def test_invalid_hub_id_is_a_clear_error():
    with pytest.raises(ModelNotFound, match="is not a valid Hugging Face hub id"):
        resolve_model("not//a valid id")


def test_hub_id_offline_raises_one_clear_line(tmp_path):
    code = ("from common.model_files import resolve_model, ModelNotFound\n"
            "try:\n    resolve_model('org/name')\n"
            "except ModelNotFound as e:\n    print(repr(str(e)))")
    proc = run_python(code, env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert ast.literal_eval(out) == ("model 'org/name' is not a local directory or .gguf file, and the "
                         "Hugging Face hub could not be reached (offline): pass a local path")


def test_gguf_converts_once_for_concurrent_starts_and_is_cached(tmp_path, monkeypatch):
    gguf = demo_model_path()
    env = {"HEADRACE_CACHE_DIR": str(tmp_path)}
    procs = [run_python(RESOLVE_SCRIPT, gguf, env=env) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    assert sum("converting" in err for _, err in outputs) == 1
    target = Path(paths.pop())
    converted = [p.name for p in (tmp_path / "gguf").iterdir() if p.is_dir()]
    assert converted == [target.name]  # and no temporary directory left behind
    names = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "generation_config.json"} <= names
    stamp = (target / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setenv("HEADRACE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_files, "convert_gguf", no_conversion)
    start = time.perf_counter()
    assert resolve_model(gguf) == target
    assert time.perf_counter() - start < 2.0
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    return resolve_model(demo_model_path())  # the default cache, shared across runs


def test_converted_demo_has_config_fast_tokenizer_and_generation_config(demo_dir):
    hf_config = load_hf_config(demo_dir)
    assert hf_config.architectures == ["LlamaForCausalLM"]
    assert getattr(hf_config, "quantization_config", None) is None
    assert max_model_len_of(hf_config) == 8192
    start = time.perf_counter()
    tokenizer = load_tokenizer(demo_dir)
    assert time.perf_counter() - start < 5.0
    assert tokenizer.is_fast
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    generation = load_generation_config(demo_dir)
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


def test_tiny_model_files_round_trip(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen3", generation={"temperature": 0.6})
    assert load_generation_config(model_dir) == {"bos_token_id": 1, "eos_token_id": 2,
                                                 "temperature": 0.6}
    assert max_model_len_of(load_hf_config(model_dir)) == 512
    other = tmp_path / "elsewhere"
    other.mkdir()
    tokenizer = load_tokenizer(other, tokenizer=str(model_dir))
    assert len(tokenizer) == 49152


def test_reading_a_directory_without_model_files(tmp_path):
    with pytest.raises(ModelNotFound, match="has no config.json"):
        load_hf_config(tmp_path)
    assert load_generation_config(tmp_path) is None
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_generation_config(tmp_path)


def test_max_model_len_falls_back_and_fails_clearly():
    assert max_model_len_of(SimpleNamespace(n_positions=1024)) == 1024
    with pytest.raises(ValueError, match="pass --max-model-len"):
        max_model_len_of(SimpleNamespace(hidden_size=64))

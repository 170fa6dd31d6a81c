"""Weight loading: safetensors routing and its error checks, dummy weights, dtypes, the
architecture registry and the KV cache shape."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import EngineConfig
from common.model_files import load_hf_config
from services.worker.layers.attention import AttentionMetadata, ForwardContext
from services.worker.layers.norm import RMSNorm
from services.worker.loader import load_model
from services.worker.models import kv_cache_shape, model_class
from tests.tiny_models import REPO_ROOT, TINY_VOCAB, make_tiny_model, tiny_config

CPU = torch.device("cpu")
SHAPES = REPO_ROOT.parent / "shared" / "models"


@torch.no_grad()
def prefill_logits(model, hf_config, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    block_size, n = 8, len(ids)
    num_blocks = -(-n // block_size)
    shape = kv_cache_shape(hf_config, num_blocks, block_size)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(model.num_layers)]
    attn = AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    return model.compute_logits(model(ids, torch.arange(n), ForwardContext(attn, caches)))


def sample_ids(n: int = 21) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(5))


def config_only_dir(tmp_path: Path, arch: str) -> Path:
    out = tmp_path / f"{arch}-config-only"
    tiny_config(arch).save_pretrained(out)
    return out


def load(model_dir: Path, dtype=torch.float32, **config):
    hf_config = load_hf_config(model_dir)
    return load_model(EngineConfig(model=str(model_dir), **config), hf_config, CPU,
                      dtype), hf_config


def test_dummy_weights_need_no_files_and_give_finite_logits(tmp_path):
    model_dir = config_only_dir(tmp_path, "qwen3")
    assert {p.name for p in model_dir.iterdir()} == {"config.json"}
    model, hf_config = load(model_dir, load_format="dummy", seed=3)
    logits = prefill_logits(model, hf_config, sample_ids())
    assert logits.shape == (21, TINY_VOCAB) and torch.isfinite(logits).all()
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(torch.equal(w, torch.ones_like(w)) for w in norms)
    weight = model.model.layers[0].mlp.down_proj.weight
    assert abs(weight.std().item() - 0.02) < 0.002


def test_dummy_weights_follow_the_seed(tmp_path):
    model_dir = config_only_dir(tmp_path, "llama")
    a, _ = load(model_dir, load_format="dummy", seed=1)
    b, _ = load(model_dir, load_format="dummy", seed=1)
    c, _ = load(model_dir, load_format="dummy", seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_dummy_bfloat16_model(tmp_path):
    model, hf_config = load(config_only_dir(tmp_path, "qwen2"), torch.bfloat16,
                            load_format="dummy")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = prefill_logits(model, hf_config, sample_ids(), torch.bfloat16)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_close_to_float32(tmp_path, dtype):
    model_dir = make_tiny_model(tmp_path, "llama")
    full, hf_config = load(model_dir)
    half, _ = load(model_dir, dtype)
    assert {p.dtype for p in half.parameters()} == {dtype}
    ref = prefill_logits(full, hf_config, sample_ids())
    ours = prefill_logits(half, hf_config, sample_ids(), dtype)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.05


def test_tied_embeddings_share_one_parameter(tmp_path):
    qwen2, _ = load(make_tiny_model(tmp_path, "qwen2"))
    assert qwen2.lm_head.weight is qwen2.model.embed_tokens.weight
    llama, _ = load(make_tiny_model(tmp_path, "llama"))
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    assert not torch.equal(llama.lm_head.weight, llama.model.embed_tokens.weight)


def test_model_dir_argument_skips_resolution(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen3")
    hf_config = load_hf_config(model_dir)
    model = load_model(EngineConfig(model="org/not-resolved"), hf_config, CPU, torch.float32,
                       model_dir)
    assert torch.isfinite(prefill_logits(model, hf_config, sample_ids())).all()


def rewrite_checkpoint(model_dir: Path, out: Path, edit) -> Path:
    shutil.copytree(model_dir, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


def test_checkpoint_mismatches_are_clear_errors(tmp_path):
    model_dir = make_tiny_model(tmp_path, "qwen2")
    q_proj = "model.layers.1.self_attn.q_proj.bias"
    missing = rewrite_checkpoint(model_dir, tmp_path / "missing",
                                 lambda t: t.pop(q_proj))
    with pytest.raises(ValueError, match=r"lacks 1 weights .*qkv_proj.bias\[q\]"):
        load(missing)
    extra = rewrite_checkpoint(model_dir, tmp_path / "extra",
                               lambda t: t.update({"model.layers.0.extra.weight": t[q_proj] + 1}))
    with pytest.raises(ValueError, match="'model.layers.0.extra.weight' has no parameter"):
        load(extra)
    reshaped = rewrite_checkpoint(model_dir, tmp_path / "reshaped",
                                  lambda t: t.update({q_proj: t[q_proj][:-1]}))
    with pytest.raises(ValueError, match=r"has shape \(63,\), the model expects 64 along"):
        load(reshaped)


def test_missing_safetensors_point_to_dummy(tmp_path):
    with pytest.raises(FileNotFoundError, match="load-format dummy"):
        load(config_only_dir(tmp_path, "llama"))


def test_unknown_and_missing_architectures_are_clear_errors(tmp_path):
    config = tiny_config("llama", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'; "
                                         "supported: LlamaForCausalLM, MistralForCausalLM"):
        model_class(config)
    with pytest.raises(ValueError, match="names no architecture"):
        model_class(tiny_config("llama", architectures=None))


@pytest.mark.parametrize("shape_dir,tp_size,expected", [
    ("qwen3-0.6b-shape", 1, (10, 16, 8, 128)),
    ("qwen3-0.6b-shape", 2, (10, 16, 4, 128)),
    ("qwen2.5-1.5b-shape", 4, (10, 16, 1, 128)),  # 2 KV heads replicated over 4 ranks
    ("llama-3.1-8b-shape", 8, (10, 16, 1, 128)),
])
def test_kv_cache_shape_of_real_configs(shape_dir, tp_size, expected):
    hf_config = load_hf_config(SHAPES / shape_dir)
    assert kv_cache_shape(hf_config, 10, 16, tp_size) == expected


def test_kv_cache_shape_rejects_uneven_split():
    with pytest.raises(ValueError, match="not divisible by the tensor parallel size"):
        kv_cache_shape(load_hf_config(SHAPES / "qwen3-0.6b-shape"), 10, 16, 3)

"""RoPE scaling schemes, partial rotary and per-layer-type parameters against transformers:
the inverse frequencies and attention factors against `ROPE_INIT_FUNCTIONS`, the cos/sin
cache against transformers' rotary embedding modules, the rotation against its
apply_rotary_pos_emb, and whole tiny models with `--rope-scaling` against transformers'
logits. The Triton kernel's partial rotary is tests/test_kernels_triton.py's check_rotary."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
import torch

from common.config import EngineConfig, add_engine_args, engine_config_from_args
from common.model_info import resolve_engine
from kernels.rotary import (ROPE_TYPES, rope_attention_factor, rope_cos_sin_cache,
                            rope_inv_freq)
from services.worker.layers.rotary import RotaryEmbedding, rope_settings
from services.worker.loader import load_model
from tests.test_models import CPU, TOLERANCE, Paged, rel_err, token_ids
from tests.tiny_models import make_tiny_model

MAX_POSITION = 512
# (rope_parameters, head_dim): every scheme, with partial rotary and the optional keys
SCHEMES: dict[str, tuple[dict[str, Any], int]] = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64),
    "linear-partial": ({"rope_type": "linear", "factor": 2.0,
                        "partial_rotary_factor": 0.75}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 64),
    "dynamic-partial": ({"rope_type": "dynamic", "factor": 2.0,
                         "partial_rotary_factor": 0.5}, 128),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 64),
    "yarn-betas-untruncated": ({"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0,
                                "beta_slow": 2.0, "truncate": False,
                                "original_max_position_embeddings": 64}, 128),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 128}, 64),
    "yarn-attention-factor-partial": ({"rope_type": "yarn", "factor": 2.0,
                                       "attention_factor": 0.8, "partial_rotary_factor": 0.5,
                                       "original_max_position_embeddings": 256}, 64),
    "yarn-no-factor": ({"rope_type": "yarn", "factor": None,
                        "original_max_position_embeddings": 128}, 64),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, 64),
}


def llama_config(params: dict[str, Any], head_dim: int, theta: float = 10000.0):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=MAX_POSITION,
                       rope_parameters={**params, "rope_theta": theta})


def phi3_longrope_config(max_position: int, original: int = 64, partial: float = 1.0):
    """A tiny Phi-3 with LongRoPE factors that differ per frequency (head_dim 32)."""
    from transformers import Phi3Config

    half = int(32 * partial) // 2
    return Phi3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_position,
                      original_max_position_embeddings=original,
                      partial_rotary_factor=partial, rope_parameters={
                          "rope_type": "longrope", "rope_theta": 10000.0,
                          "short_factor": [1.0 + 0.1 * i for i in range(half)],
                          "long_factor": [2.0 + 1.5 * i for i in range(half)]})


def ours(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    theta, scaling = rope_settings(hf_config)
    max_position = hf_config.max_position_embeddings
    return (rope_inv_freq(head_dim, theta, scaling, max_position),
            rope_attention_factor(scaling, max_position))


def transformers_inv_freq(hf_config, **kwargs: Any) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]](hf_config, **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_inv_freq_and_attention_factor_match_transformers(name: str):
    params, head_dim = SCHEMES[name]
    config = llama_config(params, head_dim)
    # dynamic: we fix the frequencies at max_position * factor (the module docstring)
    seq_len = MAX_POSITION * params["factor"] if params["rope_type"] == "dynamic" else None
    ref_inv_freq, ref_factor = transformers_inv_freq(config, seq_len=seq_len)
    inv_freq, factor = ours(config, head_dim)
    assert inv_freq.shape == (int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2,)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    unscaled = rope_inv_freq(head_dim, 10000.0, {"partial_rotary_factor":
                                                 params.get("partial_rotary_factor")})
    assert not torch.equal(inv_freq, unscaled)  # the scheme does something


def test_dynamic_is_fixed_at_the_scaled_length_not_the_current_one():
    config = llama_config({"rope_type": "dynamic", "factor": 4.0}, 64)
    inv_freq, _ = ours(config, 64)
    shorter, _ = transformers_inv_freq(config, seq_len=2 * MAX_POSITION)
    # a longer sequence: a larger base, every frequency but the constant one slower
    assert (inv_freq[1:] < shorter[1:]).all()


@pytest.mark.parametrize("max_position,long", [(512, True), (64, False)])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_inv_freq_and_attention_factor(max_position: int, long: bool, partial: float):
    """Long factors for every position where the context exceeds the original one, short
    where it cannot: transformers' choice for a sequence of max_position tokens."""
    config = phi3_longrope_config(max_position, partial=partial)
    ref_inv_freq, ref_factor = transformers_inv_freq(config, seq_len=max_position)
    inv_freq, factor = ours(config, 32)
    torch.testing.assert_close(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)
    assert (factor > 1.0) == long


@pytest.mark.parametrize("name", ["linear", "linear-partial", "yarn", "yarn-mscale",
                                  "yarn-attention-factor-partial", "llama3"])
def test_cos_sin_match_transformers_rotary_embedding(name: str):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    # Llama's module computes these schemes, partial rotary included, with
    # ROPE_INIT_FUNCTIONS and multiplies cos and sin by the attention factor
    params, head_dim = SCHEMES[name]
    config = llama_config(params, head_dim)
    check_cos_sin(RotaryEmbedding.from_config(config, head_dim).cos_sin_cache,
                  LlamaRotaryEmbedding(config), positions=torch.randperm(MAX_POSITION)[:40])


def phi3_config_with(params: dict[str, Any], head_dim: int):
    from transformers import Phi3Config

    return Phi3Config(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_POSITION,
                      rope_parameters={**params, "rope_theta": 10000.0})


def check_cos_sin(cache: torch.Tensor, module, positions: torch.Tensor, **kwargs: Any) -> None:
    cos, sin = module(torch.zeros(1, dtype=torch.float32), positions[None], **kwargs)
    ours_cos, ours_sin = cache[positions].chunk(2, dim=-1)
    torch.testing.assert_close(torch.cat((ours_cos, ours_cos), -1), cos[0], rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(torch.cat((ours_sin, ours_sin), -1), sin[0], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_cos_sin_match_phi3_beyond_the_original_context(partial: float):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = phi3_longrope_config(MAX_POSITION, partial=partial)
    cache = RotaryEmbedding.from_config(config, 32).cos_sin_cache
    # a sequence past the original 64 positions: transformers takes the long factors too
    check_cos_sin(cache, Phi3RotaryEmbedding(config), positions=torch.arange(100))
    short_config = phi3_longrope_config(64, partial=partial)
    check_cos_sin(RotaryEmbedding.from_config(short_config, 32).cos_sin_cache,
                  Phi3RotaryEmbedding(short_config), positions=torch.arange(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [0.5, 0.75])
@pytest.mark.parametrize("rope_type", ["default", "longrope"])
def test_partial_rotary_matches_transformers_apply_rotary_pos_emb(
        rope_type: str, partial: float, dtype: torch.dtype):
    from transformers.models.phi3.modeling_phi3 import (Phi3RotaryEmbedding,
                                                        apply_rotary_pos_emb)

    if rope_type == "longrope":
        config, head_dim = phi3_longrope_config(MAX_POSITION, partial=partial), 32
    else:
        config = phi3_config_with({"rope_type": "default", "partial_rotary_factor": partial}, 64)
        head_dim = 64
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, MAX_POSITION, (11,), generator=g)
    positions[3] = MAX_POSITION - 1  # past LongRoPE's original context: its long factors
    q = torch.randn(11, 4, head_dim, generator=g).to(dtype)
    k = torch.randn(11, 2, head_dim, generator=g).to(dtype)
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    rotary_dim = int(head_dim * partial)
    assert cos.shape[-1] == rotary_dim
    # transformers' layout: [batch, heads, tokens, head_dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        cos, sin)
    q_out, k_out = RotaryEmbedding.from_config(config, head_dim)(positions, q, k)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), rtol=0, atol=0)
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])


def test_an_override_without_the_original_length_takes_max_position_embeddings():
    """--rope-scaling updates rope_parameters after transformers standardized them."""
    config = llama_config({"rope_type": "default"}, 64)
    config.rope_parameters.update({"rope_type": "yarn", "factor": 4.0})
    _, scaling = rope_settings(config)
    assert scaling is not None
    assert scaling["original_max_position_embeddings"] == MAX_POSITION
    standard = llama_config({"rope_type": "yarn", "factor": 4.0}, 64)
    torch.testing.assert_close(ours(config, 64)[0], transformers_inv_freq(standard)[0],
                               rtol=1e-6, atol=0)


def test_config_level_partial_rotary_factor_joins_the_scaling():
    from types import SimpleNamespace

    old = SimpleNamespace(rope_theta=1e4, rope_scaling=None, partial_rotary_factor=0.5,
                          max_position_embeddings=64)
    theta, scaling = rope_settings(old)
    assert (theta, scaling) == (1e4, {"partial_rotary_factor": 0.5})
    cache = RotaryEmbedding.from_config(old, 64).cos_sin_cache
    assert cache.shape == (64, 32)


def gemma3_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=MAX_POSITION, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_per_layer_type_rope_matches_gemma3(layer_type: str):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = gemma3_config()
    theta, _ = rope_settings(config, layer_type)
    assert theta == (1e4 if layer_type == "sliding_attention" else 1e6)
    cache = RotaryEmbedding.from_config(config, 32, layer_type=layer_type).cos_sin_cache
    check_cos_sin(cache, Gemma3RotaryEmbedding(config), positions=torch.randperm(512)[:30],
                  layer_type=layer_type)


def test_nested_rope_parameters_need_a_layer_type_and_shared_ones_take_any():
    with pytest.raises(ValueError, match="per layer type"):
        rope_settings(gemma3_config())
    with pytest.raises(ValueError, match="per layer type"):
        rope_settings(gemma3_config(), "chunked_attention")
    shared = llama_config({"rope_type": "linear", "factor": 2.0}, 64)
    assert rope_settings(shared, "sliding_attention") == rope_settings(shared)


def test_supported_types_are_transformers_ones_and_others_fail_in_one_line():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_TYPES) - {"default"} <= set(ROPE_INIT_FUNCTIONS)
    config = llama_config({"rope_type": "linear", "factor": 2.0}, 64)
    config.rope_parameters["rope_type"] = "proportional"
    with pytest.raises(ValueError) as error:
        RotaryEmbedding.from_config(config, 64)
    message = str(error.value)
    assert "\n" not in message and "'proportional'" in message
    assert all(repr(t) in message for t in ROPE_TYPES)


def test_longrope_factors_of_the_wrong_length_are_refused():
    config = phi3_longrope_config(MAX_POSITION)
    with pytest.raises(ValueError, match="long_factor has 16 entries"):
        rope_cos_sin_cache(64, MAX_POSITION, 1e4, rope_settings(config)[1])


# --- whole models: --rope-scaling against transformers with the same parameters -----------

@pytest.mark.parametrize("arch,rope_scaling", [
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ("llama", {"rope_type": "linear", "factor": 4.0}),
])
def test_rope_scaling_flag_matches_transformers(tmp_path, arch: str,
                                                rope_scaling: dict[str, Any]):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path, arch)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(model_dir), "--dtype", "float32",
                              "--rope-scaling", json.dumps(rope_scaling)])
    resolved = resolve_engine(engine_config_from_args(args))
    model = load_model(resolved.config, resolved.hf_config, CPU, torch.float32, model_dir)

    # transformers 5 reads rope_parameters; its rope_scaling keyword drops the theta
    hf_config = AutoConfig.from_pretrained(model_dir)
    theta = hf_config.rope_parameters["rope_theta"]
    ref_config = AutoConfig.from_pretrained(
        model_dir, rope_parameters={**rope_scaling, "rope_theta": theta})
    ref = AutoModelForCausalLM.from_pretrained(model_dir, config=ref_config,
                                               dtype=torch.float32).eval()
    unscaled = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    ids = token_ids(70, seed=11)  # past the original 32 positions
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        before = unscaled(torch.tensor([ids])).logits[0]
    assert rel_err(before, expected) > 100 * TOLERANCE  # the scaling changes the logits
    paged = Paged(model, resolved.hf_config, block_size=8)
    blocks = paged.blocks(70)
    (prefill,) = paged.step([(blocks, ids[:50], 0)])
    assert rel_err(prefill, expected[:50]) < TOLERANCE
    (chunk,) = paged.step([(blocks, ids[50:57], 50)])
    assert rel_err(chunk, expected[50:57]) < TOLERANCE
    for pos in range(57, 70):  # teacher-forced decodes
        (logits,) = paged.step([(blocks, ids[pos:pos + 1], pos)])
        assert rel_err(logits, expected[pos:pos + 1]) < TOLERANCE, pos


def test_yarn_stretches_the_context_past_max_position_embeddings(tmp_path):
    """A YaRN config of 64 positions and factor 4 serves 256 (vLLM's reading: original
    positions x factor), with a cos/sin row for each, and matches transformers there."""
    from transformers import AutoModelForCausalLM

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = make_tiny_model(tmp_path, "qwen3", max_position_embeddings=64,
                                rope_parameters={**yarn, "rope_theta": 1e6})
    resolved = resolve_engine(EngineConfig(model=str(model_dir), dtype="float32"))
    assert resolved.config.max_model_len == 256
    model = load_model(resolved.config, resolved.hf_config, CPU, torch.float32, model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = token_ids(200, seed=12)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    paged = Paged(model, resolved.hf_config, block_size=16, num_blocks=32)
    blocks = paged.blocks(200)
    (prefill,) = paged.step([(blocks, ids[:150], 0)])
    assert rel_err(prefill, expected[:150]) < TOLERANCE
    (chunk,) = paged.step([(blocks, ids[150:199], 150)])
    assert rel_err(chunk, expected[150:199]) < TOLERANCE
    (logits,) = paged.step([(blocks, ids[199:200], 199)])  # a decode at position 199
    assert rel_err(logits, expected[199:200]) < TOLERANCE


def test_rope_scaling_of_a_per_layer_type_config_is_the_global_layers(tmp_path):
    """Gemma 3 keeps one set of RoPE parameters per layer type: --rope-scaling and
    --rope-theta change the full-attention layers' and leave the sliding ones'."""
    model_dir = make_tiny_model(tmp_path, "gemma3")
    resolved = resolve_engine(EngineConfig(
        model=str(model_dir), rope_theta=5e5,
        rope_scaling=json.dumps({"rope_type": "linear", "factor": 8.0})))
    full = rope_settings(resolved.hf_config, "full_attention")
    assert full == (5e5, {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5})
    assert rope_settings(resolved.hf_config, "sliding_attention") == (
        1e4, {"rope_type": "default", "rope_theta": 1e4})

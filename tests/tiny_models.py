"""Tiny random Hugging Face model directories for tests: a transformers config, seeded
random safetensors weights, SmolLM2's tokenizer (49,152 tokens, so tests feed ids below the
tiny vocabulary) and a generation_config.json.

    make_tiny_model(tmp_path, "llama")               # llama3 rope scaling
    make_tiny_model(tmp_path, "qwen2")               # qkv bias, tied embeddings
    make_tiny_model(tmp_path, "qwen3")               # q/k norm, head_dim 32 != 64 / 4
    make_tiny_model(tmp_path, "gemma2")              # soft caps, sliding/full layers
    make_tiny_model(tmp_path, "qwen2_moe")           # 8 experts, top-2, a shared expert
    make_tiny_model(tmp_path, "llama", num_hidden_layers=3)   # any config override
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shapes' directory: ../shared/models here and in CI; the device script points
# HEADRACE_SHAPES at the copy it carries (.devkit/models).
TOKENIZER_DIR = Path(os.environ.get("HEADRACE_SHAPES", REPO_ROOT.parent / "shared" / "models")
                     ) / "qwen3-0.6b-shape"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_VOCAB = 512
# large enough that attention is sharp and rotary/masking mistakes show in the logits
INIT_STD = 0.2

COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, hidden_act="silu")

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(
        architectures=["LlamaForCausalLM"], tie_word_embeddings=False,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(
        architectures=["MistralForCausalLM"], tie_word_embeddings=False, rope_theta=10000.0,
        sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(
        architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1e6,
        use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(
        architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True, rope_theta=1e6,
        head_dim=32, attention_bias=False)),
    # sliding windows of 8 and 11: the tests' 20-40 token prompts run past them
    "mistral-window": ("MistralConfig", dict(
        architectures=["MistralForCausalLM"], tie_word_embeddings=False, rope_theta=10000.0,
        sliding_window=8)),
    "qwen2-window": ("Qwen2Config", dict(  # layer 0 full, layer 1 sliding
        architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1e6,
        use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # sliding and full layers alternate; the caps are low enough to bite at INIT_STD
    "gemma2": ("Gemma2Config", dict(
        architectures=["Gemma2ForCausalLM"], tie_word_embeddings=True, num_hidden_layers=4,
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0, rope_theta=10000.0)),
    # five sliding layers, then a full one, each type with its own rope theta
    "gemma3": ("Gemma3TextConfig", dict(
        architectures=["Gemma3ForCausalLM"], tie_word_embeddings=True, num_hidden_layers=6,
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
    "phi3": ("Phi3Config", dict(
        architectures=["Phi3ForCausalLM"], tie_word_embeddings=False, rope_theta=10000.0,
        sliding_window=11, pad_token_id=0)),
    # mixture of experts: 8 experts, top-2, experts narrower than the dense MLP
    "mixtral": ("MixtralConfig", dict(
        architectures=["MixtralForCausalLM"], tie_word_embeddings=False, rope_theta=1e6,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
        intermediate_size=32)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        architectures=["Qwen2MoeForCausalLM"], tie_word_embeddings=False, rope_theta=1e6,
        use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False, rope_theta=1e6,
        head_dim=32, attention_bias=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[0])),  # layer 0 keeps a dense MLP
}


def tokenizer_dir() -> Path:
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"the test tokenizer is missing: expected {TOKENIZER_DIR}/tokenizer.json (the "
            "repository must sit beside the shared/ directory)")
    return TOKENIZER_DIR


def tiny_config(arch: str, **overrides: Any):
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {list(ARCHS)}")
    class_name, specific = ARCHS[arch]
    return getattr(transformers, class_name)(**{**COMMON, **specific, **overrides})


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random, norms around 1 and biases around 0 but not equal to them, so
    that a weight routed to the wrong place changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if param.ndim > 1:
            param.copy_(noise * INIT_STD)
        elif "norm" in name:
            param.copy_(1.0 + 0.1 * noise)
        else:
            param.copy_(0.1 * noise)


def make_tiny_model(tmp_path: Path, arch: str, *, seed: int = 0,
                    generation: dict[str, Any] | None = None, **overrides: Any) -> Path:
    """Writes a tiny `arch` model directory under tmp_path and returns it. `overrides` go
    to the transformers config; `generation` to generation_config.json."""
    from transformers import AutoModelForCausalLM

    source = tokenizer_dir()
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    out = Path(tmp_path) / f"tiny-{arch}"
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / name)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           **(generation or {})}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


@pytest.fixture(autouse=True)
def model_in_this_process(monkeypatch):
    """The engine's executor in the test's process, where the test reads its runner (graphs,
    caches, modules): on a GPU the default is a worker process (services/offline/engine.py).
    Autouse in each module that imports it; a test may set the environment itself."""
    from services.offline.engine import WORKER_PROCESS_ENV

    monkeypatch.setenv(WORKER_PROCESS_ENV, "0")


# --- vision-language models ---------------------------------------------------------------

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VL_TEXT: dict[str, Any] = dict(
    COMMON, vocab_size=49216,  # the test tokenizer's 49,152 tokens and the vision ones
    tie_word_embeddings=False,
    # head_dim 16: 8 rotary frequencies, 2 of time, 3 of height, 3 of width
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
# Qwen2.5-VL: windows of 2x2 merged tokens (56 px), full attention in block 1 only
VL_VISION: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                       out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                       hidden_act="silu", in_channels=3),
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                     hidden_act="quick_gelu", in_channels=3),
}
VL_CLASSES = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
              "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration")}
# Qwen's chat template's image parts, on the test tokenizer's ChatML
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part or 'video_url' in part %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_vl_model(tmp_path: Path, arch: str = "qwen2_5_vl", *, seed: int = 0,
                       **text_overrides: Any) -> Path:
    """A tiny Qwen2-VL / Qwen2.5-VL directory: the test tokenizer with the vision tokens
    added, Qwen's image processor settings (min_pixels small enough for 56 px images) and
    random weights. Returns it."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    out = Path(tmp_path) / f"tiny-{arch}"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config_name, model_name = VL_CLASSES[arch]
    config = getattr(transformers, config_name)(
        text_config={**VL_TEXT, **text_overrides}, vision_config=VL_VISION[arch],
        image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end, architectures=[model_name], tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64, patch_size=14,
                          temporal_patch_size=2, merge_size=2).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    return out


def make_tiny_llava(tmp_path: Path, *, seed: int = 0) -> Path:
    """A tiny LLaVA directory: a CLIP tower of 56 px crops in 14 px patches (16 tokens an
    image), the Llama decoder, the test tokenizer with `<|image_pad|>` as LLaVA's image
    token. Returns it."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, LlavaConfig,
                              LlavaForConditionalGeneration)

    out = Path(tmp_path) / "tiny-llava"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    image = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text = {**COMMON, "vocab_size": 49216, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "model_type": "llama"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2, image_size=56, patch_size=14, projection_dim=32,
                  model_type="clip_vision_model")
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=image,
                         architectures=["LlavaForConditionalGeneration"],
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
                       ).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    return out


# Gemma 3's image tokens, and a chat template that puts `<start_of_image>` for each image
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_CHAT_TEMPLATE = VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                                "<start_of_image>")


def make_tiny_gemma3_vl(tmp_path: Path, *, seed: int = 0) -> Path:
    """A tiny Gemma 3 vision-language directory: a SigLIP tower of 56 px images in 14 px
    patches (4 x 4), pooled 2 x 2 to 4 tokens an image; the gemma3 text decoder of
    ARCHS (sliding windows of 8 tokens, so windows cut through images); the test tokenizer
    with Gemma 3's image tokens added. Returns it."""
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration,
                              Gemma3ImageProcessor)

    out = Path(tmp_path) / "tiny-gemma3-vl"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_IMAGE_TOKENS)})
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    boi, eoi, image = tokenizer.convert_tokens_to_ids(list(GEMMA3_IMAGE_TOKENS))
    text = {**COMMON, **ARCHS["gemma3"][1], "vocab_size": 49216, "model_type": "gemma3_text"}
    del text["architectures"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=14, vision_use_head=False,
                  model_type="siglip_vision_model")
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=image, boi_token_index=boi, eoi_token_index=eoi,
                          architectures=["Gemma3ForConditionalGeneration"],
                          tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    randomize(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Gemma3ImageProcessor(size={"height": 56, "width": 56}).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2}, indent=2))
    return out

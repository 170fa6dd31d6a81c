"""What every stage knows about the model besides its weights: the resolved engine
settings, the tokenizer (with its chat template), the vocabulary size, the EOS ids and the
sampling defaults of its generation config. Torch-free to import, so the light processes
(gateway, tokenizer, detokenizer) stay light; the tokenizer itself comes from transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, EngineConfig, ServerConfig
from common.lora import TARGET_MODULES
from common.model_files import (allow_torch, is_gguf, load_generation_config,
                                load_hf_config, load_tokenizer, max_model_len_of,
                                read_chat_template, resolve_model, resolve_tokenizer,
                                sliding_windows, transformers_without_torch)
from common.model_support import UnsupportedModel, check_model_support, num_experts_of
from common.quantization import GGUF_FILE_ATTR
from common.sampling_defaults import SamplingDefaults, eos_token_ids, sampling_defaults


@dataclass(slots=True)
class DraftModel:
    """The draft model of --speculative-config's draft_model method."""
    model_dir: Path
    hf_config: Any


@dataclass(slots=True)
class ResolvedModel:
    config: EngineConfig  # max_model_len and the token budget filled in from the model
    model_dir: Path
    hf_config: Any  # transformers' PretrainedConfig
    draft: DraftModel | None = None


def resolve_engine(config: EngineConfig, torch_free: bool = False) -> ResolvedModel:
    """The one place an engine config meets its model's files. A model headrace cannot
    run (after --hf-overrides and --rope-scaling) is refused here, with UnsupportedModel.
    torch_free: this process runs no model, so transformers may run without torch
    (common.model_files.transformers_without_torch)."""
    model_dir = resolve_model(config.model, config.load_format, gguf_weights=False)
    if config.tokenizer is not None:  # a .gguf tokenizer converts here, before torch goes
        resolve_tokenizer(config.tokenizer)
    if torch_free:
        transformers_without_torch(model_dir, config.trust_remote_code)
    hf_config = override(load_model_config(config.model, model_dir),
                         config.hf_config_overrides())
    check_model_support(hf_config, config.quantization)
    if config.quantization == "gguf" and config.load_format == "dummy":
        raise ConfigError("--load-format dummy cannot fill GGUF blocks; leave out "
                          "--quantization gguf to run random float weights")
    check_tensor_parallel(hf_config, config.tensor_parallel_size)
    check_pipeline_parallel(hf_config, config.pipeline_parallel_size)
    if config.enable_lora:
        check_lora(hf_config)
    model_max_len = max_model_len_of(hf_config)
    if config.disable_sliding_window:
        model_max_len = without_sliding_windows(hf_config, model_max_len)
    return ResolvedModel(config.resolved(model_max_len), model_dir, hf_config,
                         resolve_draft(config, hf_config))


def load_model_config(model: str, model_dir: Path) -> Any:
    """The model's config; a GGUF file's marked with the file's path (GGUF_FILE_ATTR): its
    converted directory holds no weights until a worker needs them as float32, and a
    worker may read the file's blocks instead (services/worker/loader.py)."""
    hf_config = load_hf_config(model_dir)
    if is_gguf(model):
        setattr(hf_config, GGUF_FILE_ATTR, str(Path(model).expanduser().resolve()))
    return hf_config


def without_sliding_windows(hf_config: Any, model_max_len: int) -> int:
    """--disable-sliding-window: the config's window removed, so every layer attends to
    the whole context, and the longest sequence capped to the smallest window it had (as
    vLLM does), the context every layer was trained to see. Returns that length."""
    windows = [w for w in sliding_windows(hf_config) if w is not None]
    hf_config.sliding_window = None
    return min([model_max_len, *windows])


def resolve_draft(config: EngineConfig, hf_config: Any) -> DraftModel | None:
    """The draft model's files, None without one. It must share the target's vocabulary:
    its token ids are verified against the target's logits as they are."""
    spec = config.speculative()
    if spec is None or spec.model is None:
        return None
    if getattr(hf_config, "vision_config", None) is not None:
        raise ConfigError("--speculative-config: a draft model is not supported for a "
                          "vision-language target yet (its positions and images are the "
                          "target's alone); ngram speculation is")
    draft_dir = resolve_model(spec.model, config.load_format, gguf_weights=False)
    draft_config = load_model_config(spec.model, draft_dir)
    try:
        check_model_support(draft_config)
    except UnsupportedModel as e:
        raise UnsupportedModel(f"the draft model {spec.model}: {e}") from None
    if draft_config.vocab_size != hf_config.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft model {spec.model} has a vocabulary of "
            f"{draft_config.vocab_size} tokens, the target {hf_config.vocab_size}: a draft "
            "must share the target's tokenizer")
    return DraftModel(draft_dir, draft_config)


def override(hf_config: Any, overrides: dict[str, Any]) -> Any:
    """The config with --hf-overrides applied: a value replaces the config's, except that
    an object given for an object updates its keys (as vLLM merges them)."""
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            value = {**current, **value}
        setattr(hf_config, key, value)
    rope = getattr(hf_config, "rope_parameters", None)
    if isinstance(rope, dict):  # transformers 5 reads both from here, not the old names
        # per layer type (Gemma 3), the override is the global layers': a sliding layer
        # never sees past its window, so it has no context to stretch
        nested = {kind: p for kind, p in rope.items() if isinstance(p, dict)}
        rope = nested.get("full_attention", rope) if nested else rope
        rope.update(overrides.get("rope_scaling") or {})
        if "rope_theta" in overrides:
            rope["rope_theta"] = overrides["rope_theta"]
    return hf_config


# architectures whose checkpoints (and so PEFT adapters) fuse the projections LoRA targets
FUSED_PROJECTIONS = {"Phi3ForCausalLM": "qkv_proj and gate_up_proj"}


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """Each rank takes an equal share of the attention heads and of the MLP; KV heads are
    shared out, or replicated when there are more ranks than KV heads."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    # a mixture of experts splits each expert (and a shared expert) the same way
    mlps = [getattr(hf_config, name, None) for name in (
        "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")]
    mlp = "/".join(str(m) for m in mlps if m)
    kv_split = kv_heads % size == 0 if kv_heads >= size else size % kv_heads == 0
    if heads % size or any(m and m % size for m in mlps) or not kv_split:
        raise ConfigError(
            f"--tensor-parallel-size {size} does not split the model evenly: its {heads} "
            f"attention heads and {mlp} MLP features must divide by {size}, and its "
            f"{kv_heads} KV heads must divide by {size} or into it")


def check_pipeline_parallel(hf_config: Any, size: int) -> None:
    """Each stage holds one decoder layer at least; a vision-language model runs whole
    (its encoder and image rows feed the first stage alone, not built yet)."""
    layers = hf_config.num_hidden_layers
    if size > layers:
        raise ConfigError(f"--pipeline-parallel-size {size} exceeds the model's {layers} "
                          "layers: each stage needs one at least")
    if size > 1 and getattr(hf_config, "vision_config", None) is not None:
        raise ConfigError("--pipeline-parallel-size: vision-language models run with "
                          "--pipeline-parallel-size 1 only")


def check_lora(hf_config: Any) -> None:
    """LoRA wraps the separate dense projections: adapters of fused ones (Phi-3) target
    modules headrace does not have, and the experts' stacked weights have no adapter path,
    so an adapter of an MoE model could only be applied in part. A quantized base keeps
    its format; the adapters run beside it in the model's dtype."""
    architecture = (getattr(hf_config, "architectures", None) or ["this model"])[0]
    if architecture in FUSED_PROJECTIONS:
        raise ConfigError(f"--enable-lora is not supported for {architecture}: its adapters "
                          f"target the fused {FUSED_PROJECTIONS[architecture]}, headrace's "
                          f"LoRA the separate {', '.join(TARGET_MODULES)}")
    experts = num_experts_of(hf_config)
    if experts:
        raise ConfigError(f"--enable-lora: LoRA is not supported on mixture-of-experts "
                          f"models ({architecture} has {experts} experts per layer)")
    if getattr(hf_config, "vision_config", None) is not None:
        raise ConfigError(f"--enable-lora: LoRA is not supported on vision-language models "
                          f"({architecture}) yet")


def check_devices(config: EngineConfig, shards: int = 1) -> None:
    """A tensor-parallel rank per GPU, for each of `shards` shards: refuse what this
    machine cannot hold. Imports torch, so only the processes that run (or start) the
    model call it."""
    per_shard = config.tensor_parallel_size * config.pipeline_parallel_size
    needed = per_shard * shards
    if needed == 1 or config.device == "cpu":
        return
    allow_torch()
    import torch

    gpus = torch.cuda.device_count()
    if (config.device == "cuda" or gpus) and gpus < needed:
        raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size} x "
                          f"--pipeline-parallel-size {config.pipeline_parallel_size} x "
                          f"{shards} shard(s) needs {needed} GPUs; this machine has {gpus}")


def check_shard(engine: EngineConfig, server: ServerConfig) -> None:
    if server.shard >= engine.data_parallel_size:
        raise ConfigError(f"--shard {server.shard} is not below --data-parallel-size "
                          f"{engine.data_parallel_size}")


def shard_gpus(config: EngineConfig, shard: int) -> str:
    """CUDA_VISIBLE_DEVICES for a shard's worker: its own tensor x pipeline parallel size
    GPUs."""
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    return ",".join(str(gpu) for gpu in range(shard * size, (shard + 1) * size))


@dataclass(slots=True)
class ModelInfo:
    config: EngineConfig  # resolved
    model_dir: Path
    hf_config: Any
    tokenizer: Any
    defaults: SamplingDefaults
    eos_token_ids: tuple[int, ...]
    draft: DraftModel | None = None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def resolved(self) -> ResolvedModel:
        return ResolvedModel(self.config, self.model_dir, self.hf_config, self.draft)

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None, "resolved on load"
        return self.config.max_model_len


def load_model_info(config: EngineConfig, torch_free: bool = False) -> ModelInfo:
    """torch_free: as resolve_engine's (the gateway and tokenizer stages)."""
    model = resolve_engine(config, torch_free)
    tokenizer = load_tokenizer(model.model_dir, config.tokenizer, config.trust_remote_code)
    if config.chat_template is not None:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    generation_config = load_generation_config(model.model_dir)
    return ModelInfo(
        config=model.config, model_dir=model.model_dir, hf_config=model.hf_config,
        tokenizer=tokenizer,
        defaults=sampling_defaults(config.generation_config, generation_config,
                                   config.generation_overrides()),
        eos_token_ids=eos_token_ids(tokenizer, generation_config), draft=model.draft)

"""The supported architectures, chosen by `config.architectures[0]`, and the KV cache
shape they need."""

from __future__ import annotations

from services.worker.layers.parallel import kv_heads_per_rank
from services.worker.models.causal_lm import CausalLM, head_dim_of
from services.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from services.worker.models.gemma3_vl import Gemma3ForConditionalGeneration
from services.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from services.worker.models.llava import LlavaForConditionalGeneration
from services.worker.models.phi3 import Phi3ForCausalLM
from services.worker.models.moe import (MixtralForCausalLM, Qwen2MoeForCausalLM,
                                        Qwen3MoeForCausalLM)
from services.worker.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from services.worker.models.qwen2_vl import (Qwen2_5_VLForConditionalGeneration,
                                             Qwen2VLForConditionalGeneration)

__all__ = ["ARCHITECTURES", "CausalLM", "kv_cache_shape", "model_class"]

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
}


def model_class(hf_config) -> type[CausalLM]:
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError("config.json names no architecture (`architectures` is empty); "
                         f"supported: {', '.join(ARCHITECTURES)}")
    name = architectures[0]
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def kv_cache_shape(hf_config, num_blocks: int, block_size: int,
                   tp_size: int = 1) -> tuple[int, ...]:
    """Shape of one layer's K (or V) cache on one tensor-parallel rank."""
    num_kv_heads = kv_heads_per_rank(hf_config.num_key_value_heads, tp_size)
    return (num_blocks, block_size, num_kv_heads, head_dim_of(hf_config))

"""What models headrace can run, checked from config.json alone before any process starts:
a model it cannot run is refused in one line naming what is unsupported and what is, instead
of starting every service and then restarting a worker that cannot load it.

Torch-free, so the launcher checks without importing the model code. The names here must
equal the worker's registry (services/worker/models ARCHITECTURES) and the rotary kernel's
ROPE_TYPES (kernels/rotary.py); tests/test_model_support.py holds them equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from common.config import ConfigError
from common.model_files import rope_schemes, rope_type_of_scheme
from common.quantization import QuantizationError, quant_spec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM", "Qwen2VLForConditionalGeneration",
                           "Qwen2_5_VLForConditionalGeneration",
                           "LlavaForConditionalGeneration",
                           "Gemma3ForConditionalGeneration")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
REFUSED_EXIT = 2  # a usage error, as argparse's


class UnsupportedModel(ConfigError):
    """The model's config names an architecture, a quantization or a RoPE type that
    headrace does not implement. The message is the one line a user sees."""


def check_model_support(hf_config: Any, quantization: str | None = None) -> None:
    """Raise UnsupportedModel for the first thing in `hf_config` (after any overrides)
    or in --quantization that headrace cannot run."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise UnsupportedModel("config.json names no architecture (`architectures` is "
                               f"empty); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(f"unsupported architecture {architectures[0]!r}; supported: "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    check_quantization(hf_config, quantization)
    for rope_type in rope_types(hf_config):
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(f"unsupported RoPE type {rope_type!r}; supported: "
                                   f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def check_quantization(hf_config: Any, quantization: str | None) -> None:
    """A format the worker builds (common/quantization.py); a mixture of experts' routed
    experts are built in fp8 only."""
    try:
        spec = quant_spec(hf_config, quantization)
    except QuantizationError as e:
        raise UnsupportedModel(str(e)) from None
    experts = num_experts_of(hf_config)
    if spec is not None and experts and spec.weight_type != "fp8":
        raise UnsupportedModel(f"{spec.describe()} is not supported on mixture-of-experts "
                               f"models ({experts} experts per layer); supported there: "
                               "fp8 weights (fp8, compressed-tensors FP8 / FP8_DYNAMIC)")


def num_experts_of(hf_config: Any) -> int:
    """Routed experts per layer (Mixtral's and Qwen MoE's config names); 0 for a dense
    model."""
    return (getattr(hf_config, "num_local_experts", 0)
            or getattr(hf_config, "num_experts", 0) or 0)


def rope_types(hf_config: Any) -> Iterator[str]:
    """Every RoPE type the config uses, in any of its sets of RoPE parameters."""
    return (rope_type_of_scheme(scheme) for scheme in rope_schemes(hf_config))


def refusal_line(error: UnsupportedModel) -> str:
    """What a command prints before it exits with REFUSED_EXIT."""
    return f"headrace: {error}"

"""Which quantized format a model's weights are in, read from --quantization and config.json's
quantization_config alone (torch-free: the launcher refuses what the worker could not load
before starting anything; the worker builds its QuantMethod from the same QuantSpec).

Built: W8A8 with 8-bit weights and activations quantized on the fly,
- `fp8` (Hugging Face's FineGrainedFP8 / vLLM's fp8): e4m3 weights with a per-tensor
  `weight_scale` (static `input_scale`s, or dynamic activations) or 128 x 128 blocks of
  `weight_scale_inv` (activations per 1 x 128 group); on an unquantized checkpoint,
  --quantization fp8 quantizes the weights at load time (per output channel);
- `compressed-tensors` (llm-compressor): one config group over every Linear, 8-bit
  symmetric weights per tensor or per channel, float (FP8, FP8_DYNAMIC) or int (W8A8),
  activations dynamic per token or (float) static per tensor.

Weights only: `gguf` (llama.cpp's files, vLLM's --quantization gguf): a .gguf model's
linear weights of types Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K stay in their blocks (other
types, norms and embeddings are dequantized on load), for the Llama, Qwen2 and Qwen3
architectures. A GGUF file has no quantization_config: the worker reads its blocks by
default on CUDA, and on CPU only with --quantization gguf (else its float32 conversion);
see `gguf_default`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_TEXT = ("fp8 (per-tensor, or 128x128-block weight scales; or an unquantized "
                  "checkpoint quantized on load), compressed-tensors (FP8, FP8_DYNAMIC, "
                  "INT8 W8A8) and gguf (a .gguf file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K "
                  "weights)")
GGUF_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # whose GGUF tensors are read as they are
# the config attribute that marks a model read from a GGUF file: the file's path (set by
# common/model_info on loading the converted directory's config)
GGUF_FILE_ATTR = "gguf_file"


class QuantizationError(ValueError):
    """A quantization headrace does not run; the message is the one line a user sees."""


@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # "fp8", "compressed-tensors" or "gguf"
    weight_type: Literal["fp8", "int8", "gguf"]
    weight_strategy: Literal["tensor", "channel", "block"]
    activations: Literal["token", "static", "group", "unquantized"]  # dynamic per token /
    # static per-tensor input_scale / dynamic per 1 x block_k group / not quantized
    online: bool = False  # weights quantized at load time from an unquantized checkpoint
    block: tuple[int, int] = (128, 128)  # (output, input) features of a weight block

    def describe(self) -> str:
        """For the startup log."""
        if self.method == "gguf":
            return ("gguf (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K linear weights kept in their "
                    "blocks, other types dequantized)")
        weights = (f"{self.block[0]}x{self.block[1]} blocks" if self.weight_strategy == "block"
                   else f"per {self.weight_strategy}")
        activations = {"token": "dynamic per token", "static": "static per tensor",
                       "group": f"dynamic per 1x{self.block[1]} group"}[self.activations]
        source = ", quantized on load" if self.online else ""
        return (f"{self.method} ({self.weight_type} weights {weights}, activations "
                f"{activations}{source})")


def config_dict(quantization: Any) -> dict[str, Any]:
    """quantization_config as a dict: config.json's, or transformers' parsed object's."""
    if quantization is None or isinstance(quantization, dict):
        return quantization or {}
    return quantization.to_dict()


def quant_method_name(quantization: Any) -> str:
    method = config_dict(quantization).get("quant_method")
    return str(getattr(method, "value", method) or "unknown")


def quant_spec(hf_config: Any, engine_quantization: str | None) -> QuantSpec | None:
    """The format of the model's weights (None: unquantized), or QuantizationError."""
    if engine_quantization is not None and engine_quantization not in ENGINE_VALUES:
        raise QuantizationError(f"unsupported --quantization {engine_quantization!r}; "
                                f"supported: {SUPPORTED_TEXT}")
    if engine_quantization == "gguf" or getattr(hf_config, GGUF_FILE_ATTR, None):
        return gguf_spec(hf_config, engine_quantization)
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        if engine_quantization == "fp8":
            return QuantSpec("fp8", "fp8", "channel", "token", online=True)
        if engine_quantization is not None:
            raise QuantizationError(f"--quantization {engine_quantization} needs a "
                                    "checkpoint in that format (config.json has no "
                                    "quantization_config)")
        return None
    config = config_dict(quantization)
    method = quant_method_name(config)
    if engine_quantization is not None and engine_quantization != method:
        raise QuantizationError(f"--quantization {engine_quantization} does not match the "
                                f"checkpoint's quantization_config ({method!r})")
    if method not in PARSERS:
        raise QuantizationError(f"unsupported quantization {method!r} (config.json "
                                f"quantization_config); supported: {SUPPORTED_TEXT}")
    return PARSERS[method](config)


def gguf_spec(hf_config: Any, engine_quantization: str | None) -> QuantSpec | None:
    """A GGUF file's blocks (None: its float32 conversion, when --quantization is left
    out and the worker's default, gguf_default, chose it)."""
    if not getattr(hf_config, GGUF_FILE_ATTR, None):
        raise QuantizationError("--quantization gguf needs a .gguf model file; this model "
                                "is not one")
    if engine_quantization is None:
        return None
    if engine_quantization != "gguf":
        raise QuantizationError(f"--quantization {engine_quantization} does not apply to a "
                                "GGUF file; use gguf, or leave it out")
    if hf_config.model_type not in GGUF_MODEL_TYPES:
        raise QuantizationError(f"--quantization gguf: a {hf_config.model_type!r} GGUF file "
                                "is not read quantized; supported: "
                                f"{', '.join(GGUF_MODEL_TYPES)} (leave the flag out to run "
                                "its float32 conversion)")
    return QuantSpec("gguf", "gguf", "block", "unquantized")


def gguf_default(hf_config: Any, engine_quantization: str | None, on_cuda: bool,
                 load_format: str, lora: bool) -> str | None:
    """The --quantization a worker runs: as given, else for a GGUF file on CUDA its blocks
    (vLLM's default) where they can be read: an architecture read quantized, real weights
    (dummy ones have no blocks), no LoRA (its matmul needs a float weight). On CPU a GGUF
    file runs its float32 conversion unless asked: a float matmul beats the torch twin's
    dequantizing one there."""
    if (engine_quantization is None and on_cuda and getattr(hf_config, GGUF_FILE_ATTR, None)
            and hf_config.model_type in GGUF_MODEL_TYPES and load_format != "dummy"
            and not lora):
        return "gguf"
    return engine_quantization


def fp8_spec(config: dict[str, Any]) -> QuantSpec:
    check_ignored(config.get("modules_to_not_convert") or [], "modules_to_not_convert")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"fp8: unsupported activation_scheme {scheme!r}; supported: "
                                "dynamic, static")
    block = config.get("weight_block_size")
    if block is None:
        return QuantSpec("fp8", "fp8", "tensor", "token" if scheme == "dynamic" else "static")
    if scheme != "dynamic" or len(block) != 2:
        raise QuantizationError(f"fp8: weight_block_size {block} needs two sizes and dynamic "
                                f"activations, got activation_scheme {scheme!r}")
    return QuantSpec("fp8", "fp8", "block", "group", block=(int(block[0]), int(block[1])))


def compressed_tensors_spec(config: dict[str, Any]) -> QuantSpec:
    check_ignored(config.get("ignore") or [], "ignore")
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors: {len(groups)} config groups; "
                                "supported: one, over every Linear")
    group = groups[0]
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    what = f"compressed-tensors weights {describe_args(weights)}, activations " \
           f"{describe_args(inputs)}"
    kind = weights.get("type")
    if (weights.get("num_bits") != 8 or kind not in ("float", "int")
            or not weights.get("symmetric", True) or weights.get("dynamic")
            or weights.get("strategy") not in ("tensor", "channel") or not inputs
            or inputs.get("num_bits") != 8 or inputs.get("type") != kind
            or not inputs.get("symmetric", True)):
        raise QuantizationError(f"unsupported {what}; supported: {SUPPORTED_TEXT}")
    strategy, dynamic = inputs.get("strategy"), bool(inputs.get("dynamic"))
    if (strategy, dynamic) == ("token", True):
        activations = "token"
    elif (strategy, dynamic) == ("tensor", False) and kind == "float":
        activations = "static"
    else:
        raise QuantizationError(f"unsupported {what}; supported: {SUPPORTED_TEXT}")
    return QuantSpec("compressed-tensors", "fp8" if kind == "float" else "int8",
                     weights["strategy"], activations)


def describe_args(args: dict[str, Any] | None) -> str:
    if not args:
        return "unquantized"
    return (f"{args.get('type')}{args.get('num_bits')} {args.get('strategy')}"
            f"{' dynamic' if args.get('dynamic') else ''}"
            f"{'' if args.get('symmetric', True) else ' asymmetric'}")


def check_ignored(modules: list[str], key: str) -> None:
    """Layers left unquantized: the LM head (never quantized here) is the only one
    supported."""
    others = [m for m in modules if m.rpartition(".")[2] != "lm_head"]
    if others:
        raise QuantizationError(f"quantization_config {key} lists {others[:3]}: only "
                                "lm_head may be left unquantized")


# quant_method -> what reads its quantization_config
PARSERS = {"fp8": fp8_spec, "compressed-tensors": compressed_tensors_spec}
# --quantization's values: those, and gguf (a file format, with no quantization_config)
ENGINE_VALUES = (*PARSERS, "gguf")

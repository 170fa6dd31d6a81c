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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_TEXT = ("fp8 (per-tensor, or 128x128-block weight scales; or an unquantized "
                  "checkpoint quantized on load) and compressed-tensors (FP8, FP8_DYNAMIC, "
                  "INT8 W8A8)")


class QuantizationError(ValueError):
    """A quantization headrace does not run; the message is the one line a user sees."""


@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # "fp8" or "compressed-tensors"
    weight_type: Literal["fp8", "int8"]
    weight_strategy: Literal["tensor", "channel", "block"]
    activations: Literal["token", "static", "group"]  # dynamic per token / static
    # per-tensor input_scale / dynamic per 1 x block_k group
    online: bool = False  # weights quantized at load time from an unquantized checkpoint
    block: tuple[int, int] = (128, 128)  # (output, input) features of a weight block

    def describe(self) -> str:
        """For the startup log."""
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
    if engine_quantization is not None and engine_quantization not in PARSERS:
        raise QuantizationError(f"unsupported --quantization {engine_quantization!r}; "
                                f"supported: {SUPPORTED_TEXT}")
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

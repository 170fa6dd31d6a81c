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
  activations dynamic per token or (float) static per tensor;

and W4A16, 4-bit integer weights times unquantized activations (kernels/int4.py):
- `awq` (AutoAWQ's GEMM packing), `gptq` (checkpoint format gptq or gptq_v2, with or
  without act-order), and compressed-tensors' pack-quantized W4A16 (symmetric or not, per
  group or per channel, actorder "group" or none), each per group of input features or
  per output channel (group size -1).

A mixture of experts' routed experts take the fp8 formats (common/model_support.py
refuses int8 and int4 there); its router stays unquantized, as checkpoints leave it.

Weights only, from a file format: `gguf` (llama.cpp's files, vLLM's --quantization gguf):
a .gguf model's linear weights of types Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K stay in
their blocks (other types, norms and embeddings are dequantized on load), for the Llama,
Qwen2 and Qwen3 architectures. A GGUF file has no quantization_config: the worker reads its
blocks by default on CUDA, and on CPU only with --quantization gguf (else its float32
conversion); see `gguf_default`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SUPPORTED_TEXT = ("fp8 (per-tensor, or 128x128-block weight scales; or an unquantized "
                  "checkpoint quantized on load), compressed-tensors (FP8, FP8_DYNAMIC, "
                  "INT8 W8A8, pack-quantized W4A16), awq (4-bit, gemm), gptq (4-bit, "
                  "gptq or gptq_v2 format) and gguf (a .gguf file's "
                  "Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights)")
GGUF_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # whose GGUF tensors are read as they are
# the config attribute that marks a model read from a GGUF file: the file's path (set by
# common/model_info on loading the converted directory's config)
GGUF_FILE_ATTR = "gguf_file"


class QuantizationError(ValueError):
    """A quantization headrace does not run; the message is the one line a user sees."""


@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # "fp8", "compressed-tensors", "awq", "gptq" or "gguf"
    weight_type: Literal["fp8", "int8", "int4", "gguf"]
    weight_strategy: Literal["tensor", "channel", "block", "group"]
    activations: Literal["token", "static", "group", "none"]  # dynamic per token / static
    # per-tensor input_scale / dynamic per 1 x block_k group / unquantized (W4A16, gguf)
    online: bool = False  # weights quantized at load time from an unquantized checkpoint
    block: tuple[int, int] = (128, 128)  # (output, input) features of a weight block
    # int4 only:
    group_size: int = -1  # input features per scale and zero ("group"); -1 per channel
    zero_points: bool = True  # the checkpoint stores zeros (else 8: symmetric)
    act_order: bool = False  # input features grouped out of order, by a g_idx tensor
    stored_zero_offset: int = 0  # GPTQ's v1 format stores zero - 1

    def describe(self) -> str:
        """For the startup log."""
        if self.method == "gguf":
            return ("gguf (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K linear weights kept in their "
                    "blocks, other types dequantized)")
        weights = (f"{self.block[0]}x{self.block[1]} blocks" if self.weight_strategy == "block"
                   else f"per group of {self.group_size}" if self.weight_strategy == "group"
                   else f"per {self.weight_strategy}")
        if self.act_order:
            weights += " in act-order"
        activations = {"token": "dynamic per token", "static": "static per tensor",
                       "group": f"dynamic per 1x{self.block[1]} group",
                       "none": "unquantized"}[self.activations]
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
    return QuantSpec("gguf", "gguf", "block", "none")


def gguf_default(hf_config: Any, engine_quantization: str | None, on_cuda: bool,
                 load_format: str) -> str | None:
    """The --quantization a worker runs: as given, else for a GGUF file on CUDA its blocks
    (vLLM's default) where they can be read: an architecture read quantized, real weights
    (dummy ones have no blocks). On CPU a GGUF file runs its float32 conversion unless
    asked: a float matmul beats the torch twin's dequantizing one there."""
    if (engine_quantization is None and on_cuda and getattr(hf_config, GGUF_FILE_ATTR, None)
            and hf_config.model_type in GGUF_MODEL_TYPES and load_format != "dummy"):
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
    if not inputs and weights.get("num_bits") == 4:
        return compressed_tensors_w4a16_spec(weights, group.get("format")
                                             or config.get("format"), what)
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


def compressed_tensors_w4a16_spec(weights: dict[str, Any], fmt: str | None,
                                  what: str) -> QuantSpec:
    """4-bit integer weights packed eight to an int32 ("pack-quantized"), per group or
    per channel; actorder "group" stores each input feature's group (weight_g_idx),
    "weight" only reordered the quantization and stores nothing."""
    strategy, actorder = weights.get("strategy"), weights.get("actorder")
    if (fmt != "pack-quantized" or weights.get("type") != "int" or weights.get("dynamic")
            or strategy not in ("group", "channel")
            or actorder not in (None, False, True, "group", "weight")):
        raise QuantizationError(f"unsupported {what} (format {fmt!r}, actorder "
                                f"{actorder!r}); supported: {SUPPORTED_TEXT}")
    group_size = int(weights.get("group_size") or 0) if strategy == "group" else -1
    if strategy == "group" and group_size <= 0:
        raise QuantizationError(f"unsupported {what}: group_size {weights.get('group_size')!r}"
                                "; a positive group_size is needed")
    return QuantSpec("compressed-tensors", "int4", strategy, "none", group_size=group_size,
                     zero_points=not weights.get("symmetric", True),
                     act_order=actorder in (True, "group"))


def awq_spec(config: dict[str, Any]) -> QuantSpec:
    """AutoAWQ's quantization_config (or the w_bit / q_group_size spelling)."""
    check_ignored(config.get("modules_to_not_convert") or [], "modules_to_not_convert")
    check_four_bits("awq", config.get("bits", config.get("w_bit", 4)))
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"awq: unsupported version {version!r}; supported: gemm")
    if not config.get("zero_point", True):
        raise QuantizationError("awq: zero_point false is not supported; supported: "
                                "zero_point true (asymmetric)")
    return int4_spec("awq", config.get("group_size", config.get("q_group_size", 128)),
                     act_order=False)


def gptq_spec(config: dict[str, Any]) -> QuantSpec:
    """AutoGPTQ / GPTQModel's quantization_config. Symmetric or not, the checkpoint
    stores zeros; desc_act (act-order) says the g_idx tensors group features out of
    order."""
    check_four_bits("gptq", config.get("bits", 4))
    if config.get("lm_head"):
        raise QuantizationError("gptq: a quantized lm_head is not supported")
    fmt = config.get("checkpoint_format", config.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq: unsupported checkpoint format {fmt!r}; supported: "
                                "gptq, gptq_v2")
    return int4_spec("gptq", config.get("group_size", 128),
                     act_order=bool(config.get("desc_act")),
                     stored_zero_offset=1 if fmt == "gptq" else 0)


def int4_spec(method: str, group_size: Any, act_order: bool,
              stored_zero_offset: int = 0) -> QuantSpec:
    if not isinstance(group_size, int) or not (group_size == -1 or group_size > 0):
        raise QuantizationError(f"{method}: unsupported group_size {group_size!r}; "
                                "supported: a positive size, or -1 (per channel)")
    return QuantSpec(method, "int4", "channel" if group_size == -1 else "group", "none",
                     group_size=group_size, act_order=act_order,
                     stored_zero_offset=stored_zero_offset)


def check_four_bits(method: str, bits: Any) -> None:
    if bits != 4:
        raise QuantizationError(f"{method}: unsupported {bits}-bit weights; supported: "
                                "4-bit")


def describe_args(args: dict[str, Any] | None) -> str:
    if not args:
        return "unquantized"
    return (f"{args.get('type')}{args.get('num_bits')} {args.get('strategy')}"
            f"{' dynamic' if args.get('dynamic') else ''}"
            f"{'' if args.get('symmetric', True) else ' asymmetric'}")


# modules never quantized here, which checkpoints list as left unquantized: the LM head,
# a mixture of experts' router (`mlp.gate`, Mixtral's `block_sparse_moe.gate`) and
# Qwen2-MoE's shared expert gate
UNQUANTIZED_MODULES = ("lm_head", "gate", "shared_expert_gate")


def check_ignored(modules: list[str], key: str) -> None:
    """Layers left unquantized: only those never quantized here. An entry is a module
    name or a compressed-tensors pattern (`re:.*mlp.gate$`); its last name decides."""
    others = [m for m in modules
              if m.removeprefix("re:").removesuffix("$").rpartition(".")[2]
              not in UNQUANTIZED_MODULES]
    if others:
        raise QuantizationError(f"quantization_config {key} lists {others[:3]}: only "
                                f"{', '.join(UNQUANTIZED_MODULES)} may be left unquantized")


# quant_method -> what reads its quantization_config
PARSERS = {"fp8": fp8_spec, "compressed-tensors": compressed_tensors_spec, "awq": awq_spec,
           "gptq": gptq_spec}
# --quantization's values: those, and gguf (a file format, with no quantization_config)
ENGINE_VALUES = (*PARSERS, "gguf")

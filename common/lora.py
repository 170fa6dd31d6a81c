"""A PEFT LoRA adapter's settings (adapter_config.json), checked against the engine's.

Read wherever a request first names an adapter (the offline API, before admitting it) and
again by the worker that loads its weights, so a bad adapter is refused with its reason
rather than failing a step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# the projections of Llama-style decoders that adapters may target (PEFT's module names)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names its path and the reason."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """An adapter the server serves under a model name (vLLM's --lora-modules item)."""
    name: str
    path: str
    base_model_name: str | None = None  # the parent /v1/models names; None: the base's


def parse_lora_module(text: str) -> LoRAModule:
    """vLLM's two spellings: `name=path`, or a JSON object with name, path and optionally
    base_model_name."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules item {text!r} is not JSON: {e}") from None
        fields = {"name", "path", "base_model_name"}
        if (not isinstance(item, dict) or set(item) - fields
                or not {"name", "path"} <= set(item)
                or not all(isinstance(v, str) and v for v in item.values())):
            raise ValueError(f"--lora-modules item {text!r} must be a JSON object of the "
                             "strings name, path and optionally base_model_name")
        return LoRAModule(item["name"], item["path"], item.get("base_model_name"))
    name, equals, path = text.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"--lora-modules item {text!r} must be name=path or a JSON object")
    return LoRAModule(name, path)


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora


def read_adapter_config(path: str, max_rank: int) -> AdapterConfig:
    directory = Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {path}: cannot read adapter_config.json: {e}") \
            from None
    if not (directory / WEIGHTS_FILE).is_file():
        raise AdapterError(f"LoRA adapter {path}: no {WEIGHTS_FILE} (save it with "
                           "save_pretrained's default safe_serialization)")
    _check_supported(path, config)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"LoRA adapter {path}: r must be a positive integer and "
                           f"lora_alpha a number, got r={rank!r}, lora_alpha={alpha!r}")
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {path}: rank {rank} is above --max-lora-rank "
                           f"{max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling))


def _check_supported(path: str, config: dict) -> None:
    """PEFT features whose weights the slots have no place for are refused by name."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path}: peft_type {config['peft_type']!r} is not "
                           "LORA")
    unsupported = {"use_dora": config.get("use_dora"),
                   "bias": config.get("bias", "none") != "none",
                   "modules_to_save": config.get("modules_to_save"),
                   "rank_pattern": config.get("rank_pattern"),
                   "alpha_pattern": config.get("alpha_pattern")}
    named = [key for key, value in unsupported.items() if value]
    if named:
        raise AdapterError(f"LoRA adapter {path}: {', '.join(named)} not supported (plain "
                           f"LoRA of {', '.join(TARGET_MODULES)} only)")

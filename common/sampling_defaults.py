"""Sampling defaults from a generation config (vLLM's `--generation-config`), and EOS ids.

A model's generation_config.json may set sampling values; they become the defaults a
request starts from, and the client's own values win over them. `max_new_tokens` is
different: it caps every request's max_tokens, whatever the client asked for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.sampling_params import SamplingError, SamplingParams

# The keys vLLM takes from a generation config, by their SamplingParams names.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    values: dict[str, Any] = field(default_factory=dict)  # only keys the config set
    max_new_tokens: int | None = None

    def default_params(self) -> SamplingParams:
        """What a request gets when it sets nothing (LLM.get_default_sampling_params)."""
        if self.max_new_tokens is None:
            return SamplingParams(**self.values)
        return SamplingParams(**self.values, max_tokens=self.max_new_tokens)

    def params_for(self, overrides: dict[str, Any]) -> SamplingParams:
        """Client values over model defaults over SamplingParams defaults. A max_tokens
        the client did not set is None (up to the context length) unless capped here."""
        merged = {**self.values, **overrides}
        merged["max_tokens"] = self.cap(overrides.get("max_tokens"))
        return SamplingParams(**merged)

    def cap(self, max_tokens: int | None) -> int | None:
        if self.max_new_tokens is None:
            return max_tokens
        if max_tokens is None:
            return self.max_new_tokens
        return min(max_tokens, self.max_new_tokens)


def sampling_defaults(generation_config: str,
                      model_generation_config: dict[str, Any] | None,
                      overrides: dict[str, Any] | None = None) -> SamplingDefaults:
    """'auto': the model's generation config; 'vllm': none; else a directory holding one.
    `overrides` (--override-generation-config) go over it."""
    if generation_config == "vllm":
        config, source = {}, "--override-generation-config"
    elif generation_config == "auto":
        config, source = model_generation_config or {}, "the model's generation config"
    else:
        path = Path(generation_config) / GENERATION_CONFIG_FILE
        config, source = read_generation_config(path), str(path)
    if overrides:
        config, source = {**config, **overrides}, f"{source} with --override-generation-config"
    return defaults_from(config, source)


def read_generation_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"--generation-config: {path} does not exist (give 'auto', 'vllm' "
                         f"or a directory holding {GENERATION_CONFIG_FILE})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} must hold a JSON object")
    return config


def defaults_from(config: dict[str, Any], source: str) -> SamplingDefaults:
    values = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    max_new_tokens = config.get("max_new_tokens")
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int)
                                       or isinstance(max_new_tokens, bool)
                                       or max_new_tokens < 1):
        raise ValueError(f"{source}: max_new_tokens must be a positive integer, got "
                         f"{max_new_tokens!r}")
    defaults = SamplingDefaults(values, max_new_tokens)
    try:  # a broken config fails at start-up, not on every request
        defaults.default_params()
    except (SamplingError, TypeError) as e:
        raise ValueError(f"{source}: invalid sampling default: {e}") from None
    return defaults


def eos_token_ids(tokenizer: Any, generation_config: dict[str, Any] | None) -> tuple[int, ...]:
    """The tokenizer's EOS id and the generation config's (an int or a list), once each."""
    configured = (generation_config or {}).get("eos_token_id")
    if configured is None:
        configured = []
    elif isinstance(configured, int):
        configured = [configured]
    ids = [tokenizer.eos_token_id, *configured]
    return tuple(dict.fromkeys(i for i in ids if i is not None))

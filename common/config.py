"""Engine and server settings, with vLLM's argument names, and the one CLI parser.

Every entry point (serve, the single-process commands, generate, bench, profile) builds its
parser from these dataclasses, so a flag means the same thing everywhere. Precedence:
command line > environment (`HEADRACE_<NAME>`, and `REDIS_URL`) > the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from common.lora import LoRAModule, parse_lora_module
from common.redis_cluster import cluster_addresses, is_cluster_url
from common.redis_sentinel import is_sentinel_url, sentinel_target
from common.redis_urls import redacted
from common.sampling_params import MAX_N
from common.speculative import SpeculativeConfig, SpeculativeConfigError
from common.structured_outputs import BACKENDS
from common.vllm_flags import add_foreign_args, foreign_findings

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
POLICIES = ("fcfs", "priority")
ROUTINGS = ("prefix", "round_robin")
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel",
                 "rediss+sentinel")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder",
                     "deepseek_v3")  # built in; --tool-parser-plugin registers more
REASONING_PARSERS = ("deepseek_r1", "qwen3", "deepseek_v3", "mistral")
POOLING_TYPES = ("LAST", "MEAN")
POOLER_KEYS = ("pooling_type", "normalize")  # of vLLM's PoolerConfig, those honoured here
DEFAULT_VIDEO_FRAMES = 32  # frames sampled from a served video, as vLLM's video loader
NGRAM_MODEL = "[ngram]"  # vLLM's older --speculative-model value for prompt lookup
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class ConfigError(ValueError):
    """An invalid setting; the message names the flag, the value and what is allowed."""


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(slots=True)
class EngineConfig:
    model: str = field(default="", metadata=_help(
        "Model: a Hugging Face directory, a .gguf file, or a hub id (needs network).",
        positional_in_serve=True))
    tokenizer: str | None = field(default=None, metadata=_help(
        "Tokenizer directory or hub id; defaults to the model's."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=_help(
        "Weight and activation dtype; auto is bfloat16 on a GPU and float32 on the CPU."))
    max_model_len: int | None = field(default=None, metadata=_help(
        "Longest sequence (prompt + output) in tokens; defaults to the model's "
        "max_position_embeddings."))
    disable_sliding_window: bool = field(default=False, metadata=_help(
        "Attend to the whole context in every layer, and cap max_model_len to the model's "
        "smallest sliding window (as vLLM does)."))
    block_size: int = field(default=16, metadata=_help(
        "Tokens per KV cache block (a power of two, 1 to 128)."))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "Reuse KV blocks of identical prompt prefixes."))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "Fraction of GPU memory for weights, activations and the KV cache (0, 1]."))
    kv_cache_memory: int | None = field(default=None, metadata=_help(
        "KV cache size in bytes per GPU, instead of what --gpu-memory-utilization leaves "
        "(on a GPU the memory profile checks that it fits beside the weights, activations "
        "and CUDA graphs). Default on CPU: 1 GiB.",
        aliases=("--kv-cache-memory-bytes",)))
    num_gpu_blocks_override: int | None = field(default=None, metadata=_help(
        "Use exactly this many KV blocks (testing preemption, benchmarks)."))
    max_num_batched_tokens: int | None = field(default=None, metadata=_help(
        "Token budget of one engine step, shared by decodes and prefill chunks "
        "(default 8192, or max_model_len when chunked prefill is off)."))
    max_num_seqs: int = field(default=256, metadata=_help(
        "Most requests in one engine step."))
    enable_chunked_prefill: bool = field(default=True, metadata=_help(
        "Split long prompts across steps to fit the token budget."))
    max_num_partial_prefills: int = field(default=1, metadata=_help(
        "Most prompts whose prefill may be underway, split across steps, at once."))
    max_long_partial_prefills: int = field(default=1, metadata=_help(
        "Most of those that are long (over --long-prefill-token-threshold): below "
        "--max-num-partial-prefills, short prompts start ahead of long ones."))
    long_prefill_token_threshold: int = field(default=0, metadata=_help(
        "Prompts longer than this are long, and take at most this many tokens a step; 0 "
        "is none, or 4%% of --max-model-len with --max-num-partial-prefills above 1."))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "Number of GPUs the model is split over."))
    pipeline_parallel_size: int = field(default=1, metadata=_help(
        "Number of pipeline stages, each holding a share of the layers on "
        "--tensor-parallel-size GPUs of its own (VLLM_PP_LAYER_PARTITION, e.g. '10,11,11', "
        "sets each stage's share)."))
    data_parallel_size: int = field(default=1, metadata=_help(
        "Number of GPU shards, each a scheduler and a worker (of --tensor-parallel-size "
        "GPUs) with its own KV cache, behind the same gateways, tokenizers and "
        "detokenizers."))
    disable_custom_all_reduce: bool = field(default=False, metadata=_help(
        "All-reduce every message through NCCL, even the small ones of decode steps that "
        "otherwise take a one-shot all-reduce over the GPUs' peer memory."))
    seed: int = field(default=0, metadata=_help("Seed for weights of dummy models and "
                                                "for unseeded sampling."))
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = field(
        default="auto", metadata=_help("auto, safetensors, gguf, or dummy (random weights "
                                       "at the real shapes)."))
    generation_config: str = field(default="auto", metadata=_help(
        "Sampling defaults: 'auto' reads the model's generation_config.json, 'vllm' uses "
        "built-in defaults, a directory reads that directory's."))
    override_generation_config: str | None = field(default=None, metadata=_help(
        "Sampling defaults as a JSON object, e.g. '{\"temperature\": 0.5}', over those "
        "--generation-config gives."))
    enforce_eager: bool = field(default=False, metadata=_help(
        "Never capture or replay CUDA graphs."))
    compilation_config: str | None = field(default=None, metadata=_help(
        "vLLM's compilation level or object (-O3, -O 0, -O.level=3, -O.mode=0, "
        "'{\"level\": 3, \"cudagraph_mode\": \"NONE\"}'). headrace has no torch.compile: "
        "level (or mode) 0, or cudagraph_mode NONE, turn CUDA graphs off as "
        "--enforce-eager does; any other level keeps them on; other keys have no effect.",
        aliases=("-O",)))
    use_tqdm_on_load: bool = field(default=True, metadata=_help(
        "Show a progress bar while the weights load (the safetensors tensors read)."))
    scheduling_policy: Literal["fcfs", "priority"] = field(default="fcfs", metadata=_help(
        "fcfs: first come first served; priority: lower value first, then arrival."))
    max_logprobs: int = field(default=20, metadata=_help(
        "Most logprobs or prompt_logprobs a request may ask for."))
    limit_mm_per_prompt: str | None = field(default=None, metadata=_help(
        "Most items of each modality in one prompt, as vLLM's JSON object, e.g. "
        "'{\"image\": 2, \"video\": 1}'; unlimited where not set."))
    media_io_kwargs: str | None = field(default=None, metadata=_help(
        "How media are read, as vLLM's JSON object: '{\"video\": {\"num_frames\": N}}' "
        "samples N frames of a served video uniformly (default 32; -1 takes every frame)."))
    allowed_media_domains: list[str] = field(default_factory=list, metadata=_help(
        "Hosts whose http(s) image and video URLs the tokenizer stage may fetch; none by "
        "default, so only data: URLs are taken."))
    allowed_local_media_path: str | None = field(default=None, metadata=_help(
        "A directory whose files file:// image and video URLs may read."))
    media_fetch_timeout: float = field(default=5.0, metadata=_help(
        "Seconds an image or video URL may take to fetch."))
    max_image_bytes: int = field(default=20 * 2 ** 20, metadata=_help(
        "Largest encoded image or video a request may give (a data: URL's or a fetched "
        "one's)."))
    device: Literal["auto", "cuda", "cpu"] = field(default="auto", metadata=_help(
        "Where the model runs; auto takes CUDA when there is one."))
    guided_decoding_backend: Literal["auto", "xgrammar"] = field(default="auto", metadata=_help(
        "What enforces structured outputs (vLLM's flag; also spelled "
        "--structured-outputs-config.backend): xgrammar, which auto picks.",
        aliases=("--structured-outputs-config.backend",)))
    chat_template: str | None = field(default=None, metadata=_help(
        "A Jinja chat template, or a file holding one, used instead of the tokenizer's."))
    trust_remote_code: bool = field(default=False, metadata=_help(
        "Let transformers run a model repository's own tokenizer code. The model itself "
        "always runs headrace's implementation of its architecture."))
    hf_overrides: str | None = field(default=None, metadata=_help(
        "A JSON object over the model's config.json, e.g. '{\"max_position_embeddings\": "
        "4096}'; where both values are objects, the given keys update the config's."))
    rope_scaling: str | None = field(default=None, metadata=_help(
        "The config's rope_scaling as a JSON object (an override, as --hf-overrides)."))
    rope_theta: float | None = field(default=None, metadata=_help(
        "The config's rope_theta (an override, as --hf-overrides)."))
    quantization: str | None = field(default=None, metadata=_help(
        "The weights' quantized format: fp8 (a Hugging Face / vLLM fp8 checkpoint, or an "
        "unquantized one quantized to fp8 on load), compressed-tensors (FP8, "
        "FP8_DYNAMIC, INT8 W8A8, pack-quantized W4A16), awq or gptq (4-bit weights, "
        "16-bit activations), or gguf (a .gguf file's blocks, the default on CUDA); left "
        "out, config.json's quantization_config decides."))
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = field(
        default="auto", metadata=_help(
            "Data type of the KV cache: auto is the model's dtype; fp8 (= fp8_e4m3) and "
            "fp8_e5m2 store one byte per value, twice the blocks in the same memory, with a "
            "per-layer scale for K and for V (the checkpoint's k_scale/v_scale, else 1.0)."))
    calculate_kv_scales: bool = field(default=False, metadata=_help(
        "With an fp8 KV cache, set each layer's K and V scales from the first real forward "
        "pass (amax / the format's max) instead of the checkpoint's or 1.0; no effect with "
        "auto."))
    pooling_type: Literal["LAST", "MEAN"] = field(default="LAST", metadata=_help(
        "How /v1/embeddings pools a prompt's final hidden states (after the model's final "
        "norm): LAST takes the last token's, MEAN averages every token's."))
    override_pooler_config: str | None = field(default=None, metadata=_help(
        "vLLM's pooler settings as a JSON object, e.g. '{\"pooling_type\": \"MEAN\", "
        "\"normalize\": false}': pooling_type over --pooling-type, and normalize (default "
        "true: embeddings are L2-normalized).", aliases=("--pooler-config",)))
    enable_lora: bool = field(default=False, metadata=_help(
        "Serve requests under LoRA adapters (PEFT directories, loaded on first use), "
        "several adapters and the base model mixed in one step; with "
        "--tensor-parallel-size above 1, each rank holds its shards of every adapter."))
    max_loras: int = field(default=1, metadata=_help(
        "Most distinct LoRA adapters in one step (the GPU slots each LoRA layer holds); "
        "requests under others wait."))
    max_lora_rank: int = field(default=16, metadata=_help(
        "Highest LoRA rank an adapter may have (the slots' rank)."))
    max_cpu_loras: int | None = field(default=None, metadata=_help(
        "Most LoRA adapters kept loaded in host memory, least recently used evicted; "
        "defaults to --max-loras."))
    lora_modules: list[str] = field(default_factory=list, metadata=_help(
        "LoRA adapters the server serves from its start, each name=path or a JSON object "
        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's model "
        "names one. Needs --enable-lora."))
    speculative_config: str | None = field(default=None, metadata=_help(
        "Speculative decoding as vLLM's JSON object: ngram (prompt lookup), e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}', or a draft model sharing "
        "the target's vocabulary, e.g. '{\"method\": \"draft_model\", \"model\": DIR, "
        "\"num_speculative_tokens\": 3}' (loaded with --load-format and --dtype; "
        "tensor-parallel size 1 only)."))
    speculative_model: str | None = field(default=None, metadata=_help(
        "vLLM's older flag: --speculative-config's draft model (its directory, .gguf or "
        "hub id), or '[ngram]' for the ngram method."))
    num_speculative_tokens: int | None = field(default=None, metadata=_help(
        "vLLM's older flag: --speculative-config's num_speculative_tokens."))
    ngram_prompt_lookup_max: int | None = field(default=None, metadata=_help(
        "vLLM's older flag: --speculative-config's prompt_lookup_max."))
    ngram_prompt_lookup_min: int | None = field(default=None, metadata=_help(
        "vLLM's older flag: --speculative-config's prompt_lookup_min."))

    def __post_init__(self) -> None:
        if isinstance(self.compilation_config, (int, dict)):  # vLLM's LLM takes these
            self.compilation_config = json.dumps(self.compilation_config)
        if isinstance(self.media_io_kwargs, dict):  # as vLLM's LLM takes it
            self.media_io_kwargs = json.dumps(self.media_io_kwargs)
        self.validate()
        if not self.compilation()[0]:
            self.enforce_eager = True

    def mm_limits(self) -> dict[str, int]:
        """--limit-mm-per-prompt as {modality: most items}; an empty dict: no limits."""
        if self.limit_mm_per_prompt is None:
            return {}
        try:
            limits = json.loads(self.limit_mm_per_prompt)
        except ValueError:
            limits = None
        if not isinstance(limits, dict) or not all(
                isinstance(v, int) and v >= 0 for v in limits.values()):
            raise ConfigError("--limit-mm-per-prompt must be a JSON object of counts, e.g. "
                              f"'{{\"image\": 2}}', got {self.limit_mm_per_prompt!r}")
        return limits

    def video_num_frames(self) -> int:
        """--media-io-kwargs' video num_frames: how many frames of a served video are
        sampled; -1: all of them."""
        kwargs = _json_object("--media-io-kwargs", self.media_io_kwargs)
        video = kwargs.get("video", {})
        if set(kwargs) - {"video"} or not isinstance(video, dict) or set(video) - {"num_frames"}:
            raise ConfigError("--media-io-kwargs: only the video's num_frames is supported, "
                              f"got {self.media_io_kwargs}")
        num_frames = video.get("num_frames", DEFAULT_VIDEO_FRAMES)
        if type(num_frames) is not int or not (num_frames == -1 or num_frames > 0):
            raise ConfigError("--media-io-kwargs: the video's num_frames must be a positive "
                              f"count or -1, got {num_frames!r}")
        return num_frames

    def validate(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"--block-size must be one of {list(BLOCK_SIZES)}, got "
                              f"{self.block_size}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("max_logprobs", self.max_logprobs, allow_zero=True)
        self.mm_limits()
        self.video_num_frames()
        self._validate_partial_prefills()
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None:
                _positive(name, value)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        _choice("dtype", self.dtype, DTYPES)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("scheduling_policy", self.scheduling_policy, POLICIES)
        _choice("device", self.device, ("auto", "cuda", "cpu"))
        _choice("guided_decoding_backend", self.guided_decoding_backend, BACKENDS)
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self.generation_overrides()
        self.hf_config_overrides()
        self.pooling()
        self._validate_lora()
        self.speculative()
        self.compilation()
        if (self.max_num_batched_tokens is not None and self.max_model_len is not None
                and not self.enable_chunked_prefill
                and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({self.max_model_len}) with chunked prefill off: a long "
                "prompt could never be scheduled; raise it or enable chunked prefill")
        if (self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_num_seqs):
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-num-seqs ({self.max_num_seqs}) so every running request can decode")

    def generation_overrides(self) -> dict[str, Any]:
        """--override-generation-config's object ({} without it)."""
        return _json_object("--override-generation-config", self.override_generation_config)

    def hf_config_overrides(self) -> dict[str, Any]:
        """What replaces the model config's values: --hf-overrides, then --rope-scaling and
        --rope-theta over it."""
        overrides = _json_object("--hf-overrides", self.hf_overrides)
        if self.rope_scaling is not None:
            overrides["rope_scaling"] = _json_object("--rope-scaling", self.rope_scaling)
        if self.rope_theta is not None:
            overrides["rope_theta"] = self.rope_theta
        return overrides

    def pooling(self) -> tuple[str, bool]:
        """(pooling type, normalize): --pooling-type, under --override-pooler-config's."""
        text = self.override_pooler_config
        value = _json_object("--override-pooler-config", text)
        if set(value) - set(POOLER_KEYS):
            raise ConfigError(f"--override-pooler-config must be a JSON object with the keys "
                              f"{', '.join(POOLER_KEYS)} (the others of vLLM's PoolerConfig "
                              f"have no effect here), got {text}")
        kind = value.get("pooling_type", self.pooling_type)
        normalize = value.get("normalize", True)
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ConfigError(f"--pooling-type (or --override-pooler-config's pooling_type) "
                              f"must be one of {list(POOLING_TYPES)}, got {kind!r}")
        if not isinstance(normalize, bool):
            raise ConfigError(f"--override-pooler-config's normalize must be true or false, "
                              f"got {normalize!r}")
        return kind.upper(), normalize

    def speculative(self) -> SpeculativeConfig | None:
        """--speculative-config, with the older flags filling in what it leaves out."""
        value: dict[str, Any] = {}
        if self.speculative_config is not None:
            try:
                value = json.loads(self.speculative_config)
            except ValueError as e:
                raise ConfigError(f"--speculative-config is not JSON: {e}") from None
            if not isinstance(value, dict):
                raise ConfigError(f"--speculative-config must be a JSON object, got "
                                  f"{self.speculative_config}")
        older = {"num_speculative_tokens": self.num_speculative_tokens,
                 "prompt_lookup_max": self.ngram_prompt_lookup_max,
                 "prompt_lookup_min": self.ngram_prompt_lookup_min}
        for key, given in older.items():
            if given is not None:
                value.setdefault(key, given)
        if self.speculative_model == NGRAM_MODEL:
            value.setdefault("method", "ngram")
        elif self.speculative_model is not None:
            value.setdefault("model", self.speculative_model)
        if not value:
            return None
        if "model" not in value:
            value.setdefault("method", "ngram")
        try:
            spec = SpeculativeConfig.from_dict(value)
        except SpeculativeConfigError as e:
            raise ConfigError(f"--speculative-config: {e}") from None
        if spec.uses_draft_model and self.tensor_parallel_size > 1:
            raise ConfigError("--speculative-config: a draft model runs with "
                              "--tensor-parallel-size 1 only (the draft and its KV cache "
                              "live on the first GPU, which the other ranks cannot follow)")
        return spec

    def compilation(self) -> tuple[bool, str | None]:
        """(CUDA graphs allowed, what the log says of it) for --compilation-config / -O:
        headrace has no torch.compile, so a level says only whether graphs run."""
        text = self.compilation_config
        if text is None:
            return True, None
        value = _compilation_object(text)
        level = value.get("mode", value.get("level"))
        if level is not None and (not isinstance(level, int) or not 0 <= level <= 3):
            raise ConfigError(f"--compilation-config's level must be 0 to 3, got {level!r}")
        graphs = level != 0 and str(value.get("cudagraph_mode", "")).upper() != "NONE"
        others = sorted(set(value) - {"mode", "level", "cudagraph_mode"})
        on = graphs and not self.enforce_eager
        note = (f"--compilation-config {text}: no torch.compile here; CUDA graphs "
                f"{'on' if on else 'off (as --enforce-eager)'}")
        if others:
            note += f"; no effect: {', '.join(others)}"
        return graphs, note

    def _validate_partial_prefills(self) -> None:
        _positive("max_num_partial_prefills", self.max_num_partial_prefills)
        _positive("max_long_partial_prefills", self.max_long_partial_prefills)
        _positive("long_prefill_token_threshold", self.long_prefill_token_threshold,
                  allow_zero=True)
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ConfigError(
                f"--max-long-partial-prefills ({self.max_long_partial_prefills}) must not "
                f"exceed --max-num-partial-prefills ({self.max_num_partial_prefills})")
        if not self.enable_chunked_prefill and (self.max_num_partial_prefills > 1
                                                or self.long_prefill_token_threshold):
            raise ConfigError("--max-num-partial-prefills above 1 and "
                              "--long-prefill-token-threshold need chunked prefill")

    def _validate_lora(self) -> None:
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                              f"--max-loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        names = [module.name for module in self.loras()]
        if len(names) != len(set(names)):
            raise ConfigError(f"--lora-modules names an adapter twice: {names}")

    def loras(self) -> list[LoRAModule]:
        """--lora-modules, parsed."""
        try:
            return [parse_lora_module(text) for text in self.lora_modules]
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def resolved(self, model_max_len: int) -> EngineConfig:
        """A copy with the model-dependent defaults filled in."""
        if self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ConfigError(f"--max-model-len {self.max_model_len} is longer than the "
                              f"model's {model_max_len} positions")
        max_model_len = self.max_model_len or model_max_len
        budget = self.max_num_batched_tokens
        if budget is None:  # every running request must fit a decode in one step
            floor = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
            budget = max(floor, self.max_num_seqs)
        threshold = self.long_prefill_token_threshold
        if threshold == 0 and self.max_num_partial_prefills > 1:
            threshold = max(1, max_model_len * 4 // 100)  # vLLM's default
        return dataclasses.replace(self, max_model_len=max_model_len,
                                   max_num_batched_tokens=budget,
                                   long_prefill_token_threshold=threshold)


@dataclass(slots=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=_help("Address the gateway listens on."))
    port: int = field(default=8000, metadata=_help("Port the gateway listens on."))
    served_model_name: list[str] = field(default_factory=list, metadata=_help(
        "Model names the API answers to; the first is reported. Defaults to --model."))
    api_key: str | None = field(default=None, metadata=_help(
        "Require this bearer token on /v1 requests."))
    redis_url: str | None = field(default=None, metadata=_help(
        "Redis to link the services through (redis://, rediss://, unix://), a Redis "
        "Cluster as redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...] (any of its "
        "masters; each data-parallel shard's keys share one hash slot), or a master "
        "watched by Sentinel as redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]"
        "/SERVICE[/DB] (the sentinels' addresses; ?sentinel_password=... if they want "
        "one); rediss+cluster:// and rediss+sentinel:// for TLS, with rediss://'s ssl_* "
        "query options. Without it an embedded "
        "redis-server is started on a unix socket.", env="REDIS_URL"))
    api_server_count: int | None = field(default=None, metadata=_help(
        "Gateway processes serving one port (SO_REUSEPORT), each with its own reply stream; "
        "`headrace serve` starts them, a lone `headrace gateway` then shares its port. "
        "Default for serve: sized from the cores it may run on (os.sched_getaffinity), "
        "printed at startup: 1 per 3 cores left after Redis and each shard's worker and "
        "scheduler, 1 to 8 (1 on 2 cores, 4 on 16)."))
    tokenizer_replicas: int | None = field(default=None, metadata=_help(
        "Tokenizer processes. Default for serve: sized from the cores, 1 per 6 cores left "
        "after Redis and each shard's worker and scheduler, 1 to 4 (1 on 2 cores, 2 on 16)."))
    shard: int = field(default=0, metadata=_help(
        "The data-parallel shard a scheduler or worker serves, 0 to --data-parallel-size "
        "minus 1 (for shards started one by one; `headrace serve` numbers its own)."))
    data_parallel_start_rank: int = field(default=0, metadata=_help(
        "serve: the first shard this host runs, as in vLLM (with --data-parallel-size-local, "
        "for one `headrace serve` per host against a shared Redis)."))
    data_parallel_size_local: int | None = field(default=None, metadata=_help(
        "serve: how many shards this host runs, from --data-parallel-start-rank (default: "
        "all of --data-parallel-size). Below it, the host's gateways, tokenizers and "
        "detokenizers take replica ids of their own (START.I), unique across hosts."))
    data_parallel_routing: Literal["prefix", "round_robin"] = field(
        default="prefix", metadata=_help(
            "How the tokenizers pick a request's shard: prefix sends requests whose first "
            "KV blocks match to the same shard (where that prefix is cached) unless it is "
            "much busier than the least loaded one; round_robin takes turns."))
    detokenizer_replicas: int | None = field(default=None, metadata=_help(
        "Detokenizer processes. Default for serve: sized from the cores as the tokenizers "
        "are (1 on 2 cores, 2 on 16)."))
    max_queue_len: int = field(default=1024, metadata=_help(
        "Admission bound: the gateway answers 503 while more requests than this are queued."))
    stream_maxlen: int = field(default=100_000, metadata=_help(
        "Approximate MAXLEN each stream is trimmed to."))
    image_ttl: float = field(default=3600.0, metadata=_help(
        "Seconds an image's pixels stay in Redis (hr:image:<hash>) past their last use: "
        "the scheduler renews the keys of the requests it holds, so this only bounds "
        "what finished or lost requests leave behind."))
    run_dir: str = field(default="run", metadata=_help(
        "Directory for the embedded Redis socket and process files."))
    max_request_body: int = field(default=8 * 2**20, metadata=_help(
        "Largest request body in bytes (413 above it)."))
    reclaim_idle_ms: int = field(default=30_000, metadata=_help(
        "A tokenizer takes over another replica's pending entries once they have been idle "
        "this long (the replica died)."))
    max_n: int = field(default=MAX_N, metadata=_help(
        f"Most completions one request may ask for (n), at most {MAX_N}."))
    max_prompts_per_request: int = field(default=256, metadata=_help(
        "Most prompts one completions call may batch (each is a request of its own)."))
    max_stop_strings: int = field(default=64, metadata=_help(
        "Most stop strings a request may give (each is matched on every step)."))
    max_stop_length: int = field(default=1024, metadata=_help(
        "Longest stop string, in characters."))
    max_stop_token_ids: int = field(default=1024, metadata=_help(
        "Most stop token ids a request may give."))
    timeout_keep_alive: float = field(default=5.0, metadata=_help(
        "Seconds a gateway connection may sit idle, or take to send a request's headers, "
        "before the gateway closes it (a slow or half-open client holds nothing longer)."))
    body_timeout: float = field(default=30.0, metadata=_help(
        "Seconds a request's body may take to arrive (408 after that)."))
    shutdown_timeout: float = field(default=30.0, metadata=_help(
        "On SIGTERM a gateway stops admitting (503) and gives the requests in flight this "
        "many seconds to finish, then ends the rest with an error."))
    enable_auto_tool_choice: bool = field(default=False, metadata=_help(
        "Let the model decide when to call tools (tool_choice \"auto\", the default when a "
        "request has tools); needs --tool-call-parser."))
    tool_call_parser: str | None = field(
        default=None, metadata=_help(
            "How tool calls are read from the model's output: hermes (Hermes, Qwen2.5, "
            "Qwen3: <tool_call> JSON blocks), llama3_json (Llama 3.1 and 3.2: JSON "
            "objects with name and parameters), mistral ([TOOL_CALLS]), pythonic "
            "([f(a=1)]), qwen3_coder (<function=...><parameter=...>), deepseek_v3 "
            "(<｜tool▁calls▁begin｜>), or a name --tool-parser-plugin registers."))
    tool_parser_plugin: str | None = field(
        default=None, metadata=_help(
            "A Python file that registers tool parsers (register_tool_parser of "
            "services/gateway/tool_calls.py), whose names --tool-call-parser then takes."))
    reasoning_parser: Literal["deepseek_r1", "qwen3", "deepseek_v3", "mistral"] | None = field(
        default=None, metadata=_help(
            "Send a thinking model's reasoning as reasoning_content apart from the "
            "content: deepseek_r1 (the prompt opens <think>), qwen3 (the output does), "
            "deepseek_v3 (deepseek_r1's where the request's chat_template_kwargs set "
            "thinking or enable_thinking, none otherwise) or mistral (Magistral's "
            "[THINK]...[/THINK], special tokens the detokenizer then keeps)."))
    disable_log_requests: bool = field(default=False, metadata=_help(
        "Leave out the gateway's log lines of each request (queued, finished, refused); "
        "its warnings and errors stay."))
    enable_log_requests: bool | None = field(default=None, metadata=_help(
        "vLLM's later spelling (off by default there): --no-enable-log-requests is "
        "--disable-log-requests; headrace logs each request unless told not to."))
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug",
                               "trace"] = field(default="info", metadata=_help(
        "Log level of the gateway processes (vLLM's flag for its HTTP server); debug and "
        "trace also log one access line per HTTP request."))
    disable_uvicorn_access_log: bool = field(default=False, metadata=_help(
        "No access lines, whatever --uvicorn-log-level says."))
    root_path: str | None = field(default=None, metadata=_help(
        "The path prefix a path-based proxy serves this API under, e.g. /llm: every route "
        "answers both with the prefix and without it (a proxy that strips it)."))
    allowed_origins: list[str] = field(default_factory=lambda: ["*"], metadata=_help(
        "CORS: origins a browser may call from, as a JSON list ('[\"https://a.example\"]') "
        "or words; [\"*\"] is any."))
    allowed_methods: list[str] = field(default_factory=lambda: ["*"], metadata=_help(
        "CORS: methods a browser may use (JSON list or words)."))
    allowed_headers: list[str] = field(default_factory=lambda: ["*"], metadata=_help(
        "CORS: request headers a browser may send (JSON list or words)."))
    allow_credentials: bool = field(default=False, metadata=_help(
        "CORS: let browsers send cookies and authorization (the allowed origin is then "
        "echoed, never *)."))
    ssl_keyfile: str | None = field(default=None, metadata=_help(
        "Serve HTTPS with this private key (PEM); needs --ssl-certfile."))
    ssl_certfile: str | None = field(default=None, metadata=_help(
        "Serve HTTPS with this certificate chain (PEM); needs --ssl-keyfile."))
    ssl_ca_certs: str | None = field(default=None, metadata=_help(
        "CA certificates (PEM) that client certificates are verified against."))
    ssl_cert_reqs: int = field(default=0, metadata=_help(
        "Client certificates: 0 not asked for, 1 optional, 2 required (Python's "
        "ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)."))
    return_tokens_as_token_ids: bool = field(default=False, metadata=_help(
        "Name logprob tokens 'token_id:N' instead of their text (tokens that are not "
        "whole UTF-8 stay identifiable); a request may also ask with the same field."))
    enable_request_id_headers: bool = field(default=False, metadata=_help(
        "Answer every HTTP request with an X-Request-Id header: the request's own, or a "
        "fresh id (a response's id follows X-Request-Id, or the body's request_id, "
        "either way)."))
    enable_prompt_tokens_details: bool = field(default=False, metadata=_help(
        "Report usage.prompt_tokens_details (cached_tokens: the prompt tokens the prefix "
        "cache held); without it the field is null, as in vLLM."))

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            setattr(self, name, _words(name, getattr(self, name)))
        if self.root_path is not None:  # "/llm/" is "/llm", "/" no prefix at all
            self.root_path = self.root_path.rstrip("/") or None
        self.validate()

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        for name in STAGE_COUNTS:
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("max_queue_len", "stream_maxlen", "max_request_body", "reclaim_idle_ms",
                     "max_prompts_per_request", "max_stop_strings", "max_stop_length",
                     "max_stop_token_ids"):
            _positive(name, getattr(self, name))
        _positive("shutdown_timeout", self.shutdown_timeout, allow_zero=True)
        _positive("shard", self.shard, allow_zero=True)
        _positive("data_parallel_start_rank", self.data_parallel_start_rank, allow_zero=True)
        if self.data_parallel_size_local is not None:
            _positive("data_parallel_size_local", self.data_parallel_size_local)
        _choice("data_parallel_routing", self.data_parallel_routing, ROUTINGS)
        if not 1 <= self.max_n <= MAX_N:
            raise ConfigError(f"--max-n must be in [1, {MAX_N}], got {self.max_n}")
        _positive("timeout_keep_alive", self.timeout_keep_alive)
        _positive("body_timeout", self.body_timeout)
        _positive("image_ttl", self.image_ttl)
        if self.redis_url is not None:
            _check_redis_url(self.redis_url)
        if self.tool_parser_plugin is not None and not os.path.isfile(self.tool_parser_plugin):
            raise ConfigError(f"--tool-parser-plugin: no such file {self.tool_parser_plugin!r}")
        if self.tool_call_parser is not None and self.tool_parser_plugin is None:
            # a plugin's names are known once the gateway has run it
            _choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.reasoning_parser is not None:
            _choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        _choice("uvicorn_log_level", self.uvicorn_log_level, UVICORN_LOG_LEVELS)
        self._validate_tls()
        if self.root_path is not None and not self.root_path.startswith("/"):
            raise ConfigError(f"--root-path must start with /, e.g. /llm; got "
                              f"{self.root_path!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                              f"{list(TOOL_CALL_PARSERS)})")


    def _validate_tls(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together: give both to "
                              "serve HTTPS")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ConfigError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 "
                              f"(required), got {self.ssl_cert_reqs}")
        if self.ssl_keyfile is None and (self.ssl_ca_certs or self.ssl_cert_reqs):
            raise ConfigError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-keyfile and "
                              "--ssl-certfile")

    @property
    def logs_requests(self) -> bool:
        return not self.disable_log_requests and self.enable_log_requests is not False

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def sized(self, cores: int, shards: int = 1) -> ServerConfig:
        """The stage counts not given, sized for `cores` (those serve may run on) and
        `shards` (each a worker and a scheduler)."""
        sized = stage_counts(cores, shards)
        return dataclasses.replace(self, **{name: sized[name] for name in STAGE_COUNTS
                                            if getattr(self, name) is None})


STAGE_COUNTS = ("api_server_count", "tokenizer_replicas", "detokenizer_replicas")


def stage_counts(cores: int, shards: int = 1) -> dict[str, int]:
    """The I/O stages' processes for a host: Redis and each shard's worker and scheduler
    keep a core each, and what is left goes to gateways (one per 3 cores, up to 8: they
    parse JSON and write every stream's chunks) and to tokenizers and detokenizers (one of
    each per 6, up to 4), leaving about a third of it for bursts and the system.
    A 2-core box keeps one of each; a 16-core GPU host gets 4 gateways and 2 + 2 replicas,
    the layout that served 1000 concurrent requests at 1.5x the throughput of one of each
    (issue 31)."""
    spare = max(0, cores - 1 - 2 * shards)
    return {"api_server_count": min(8, max(1, spare // 3)),
            "tokenizer_replicas": min(4, max(1, spare // 6)),
            "detokenizer_replicas": min(4, max(1, spare // 6))}


def _words(name: str, given: list[str]) -> list[str]:
    """A CORS list as vLLM takes it, one JSON list ('["a", "b"]'), or as words."""
    if len(given) == 1 and given[0].lstrip().startswith("["):
        try:
            value = json.loads(given[0])
        except ValueError as e:
            raise ConfigError(f"{_flag(name)} is not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{_flag(name)} must be a JSON list of strings, got {given[0]}")
        return value
    return list(given)


def _check_redis_url(url: str) -> None:
    scheme = url.partition("://")[0]
    if scheme not in REDIS_SCHEMES:
        raise ConfigError(f"--redis-url must start with one of "
                          f"{', '.join(s + '://' for s in REDIS_SCHEMES)}; got {redacted(url)!r}")
    try:
        if is_cluster_url(url):
            cluster_addresses(url)
        elif is_sentinel_url(url):
            sentinel_target(url)
    except ValueError as e:
        raise ConfigError(f"--redis-url: {e}") from e


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_object(flag: str, text: str | None) -> dict[str, Any]:
    """A flag's JSON object ({} when the flag is not given)."""
    try:
        value = json.loads(text) if text is not None else {}
    except ValueError as e:
        raise ConfigError(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {text}")
    return value


def _compilation_object(text: str) -> dict[str, Any]:
    """vLLM's spellings: a level ("3"), a dotted key from -O.key=value (".level=3"), or a
    JSON object."""
    text = text.strip()
    if text.isdigit():
        return {"level": int(text)}
    if text.startswith(".") and "=" in text:
        key, _, raw = text[1:].partition("=")
        return {key: int(raw) if raw.isdigit() else raw}
    return _json_object("--compilation-config", text)


def _positive(name: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"{_flag(name)} must be {bound}, got {value}")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{_flag(name)} must be one of {list(allowed)}, got {value!r}")


# --- CLI -------------------------------------------------------------------------------

def _base_type(annotation: Any) -> tuple[type, tuple[str, ...] | None, bool]:
    """(scalar type, choices, is_list) of a field annotation such as `int | None`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), choices, False
    if origin is list:
        return typing.get_args(annotation)[0], None, True
    return annotation, None, False


def _parse_env(raw: str, kind: type, is_list: bool) -> Any:
    if is_list:
        return [kind(x) for x in raw.replace(",", " ").split()]
    if kind is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type,
                       positional: str | None = None) -> None:
    """Add one flag per field of `cls`; `positional` names a field also taken positionally."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        kind, choices, is_list = _base_type(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        env_name = f.metadata.get("env", "HEADRACE_" + f.name.upper())
        if env_name in os.environ:
            try:
                default = _parse_env(os.environ[env_name], kind, is_list)
            except ValueError as e:
                raise ConfigError(f"environment {env_name}={os.environ[env_name]!r}: {e}")
        help_text = f.metadata.get("help", "") + f" [env {env_name}]"
        flags = [_flag(f.name), *f.metadata.get("aliases", ())]
        if f.name == positional:
            group.add_argument(f.name + "_pos", nargs="?", metavar=f.name.upper(),
                               default=None, help=f"same as {_flag(f.name)}")
        if kind is bool:
            group.add_argument(*flags, dest=f.name, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        elif is_list:
            group.add_argument(*flags, dest=f.name, default=default, nargs="+", type=kind,
                               help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, default=default, type=kind,
                               choices=choices, help=help_text)


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    add_dataclass_args(parser, EngineConfig, positional="model" if positional_model else None)
    add_foreign_args(parser)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, ServerConfig)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name)}
    positional = getattr(args, "model_pos", None)
    if cls is EngineConfig and positional:
        values["model"] = positional
    return cls(**values)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine flags' config; vLLM's flags that have no setting here are refused or
    warned about (common/vllm_flags.py)."""
    warnings, refusal = foreign_findings(args)
    if refusal is not None:
        raise ConfigError(refusal)
    config = config_from_args(EngineConfig, args)
    if not config.model:
        raise ConfigError("a model is required: give MODEL or --model")
    if (compiled := config.compilation()[1]) is not None:
        warnings.append(compiled)
    for warning in warnings:
        logging.getLogger("headrace.config").warning(warning)
    return config


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return config_from_args(ServerConfig, args)


def parse_configs(parser: argparse.ArgumentParser, argv: list[str]
                  ) -> tuple[argparse.Namespace, EngineConfig, ServerConfig]:
    """The command line of a command with engine and server flags; a bad setting exits
    with the parser's usage error."""
    args = parser.parse_args(argv)
    try:
        return args, engine_config_from_args(args), server_config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))


def engine_args_to_cli(config: EngineConfig) -> list[str]:
    """The flags that rebuild `config` in a child process (only the non-defaults)."""
    return _to_cli(config, EngineConfig())


def server_args_to_cli(config: ServerConfig) -> list[str]:
    return _to_cli(config, ServerConfig())


def _to_cli(config: Any, defaults: Any) -> list[str]:
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value, default = getattr(config, f.name), getattr(defaults, f.name)
        if value == default or value is None:
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, list):  # an empty list as JSON: the flag takes 1 or more
            argv += [_flag(f.name), *(map(str, value) if value else ["[]"])]
        else:
            argv += [_flag(f.name), str(value)]
    return argv

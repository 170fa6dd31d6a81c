"""vLLM's `serve` flags that headrace has no setting for, so a vLLM command line still
parses: each is either without effect here (a warning says why), always on here (a warning
says so), or refused unless left at vLLM's default (a one-line error says why). A switch's
--no- form is treated as the switch is. The flags headrace implements are
EngineConfig's and ServerConfig's fields, with the same names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class ForeignFlag:
    name: str  # vLLM's flag without the dashes
    kind: type  # what its value parses as; bool for a switch
    fate: Literal["ignored", "refused", "always"]  # always: on here, whatever is given
    why: str
    default: Any = None  # vLLM's default: a refused flag is accepted at this value
    accepted: tuple[Any, ...] = ()  # other values a refused flag is accepted at


_RECOMPUTE = "preemption recomputes (as in vLLM v1), nothing is swapped to the CPU"
_AHEAD = "the scheduler always plans the next step while the worker runs this one"
_TOKENIZERS = "tokenizers are processes of their own: use --tokenizer-replicas"
_PINNED = ("download that revision (`hf download MODEL --revision R`) and pass its "
           "directory")
_LORA = ("headrace's LoRA (--enable-lora) takes PEFT adapters of q/k/v/o and gate/up/down "
         "projections, without bias or extra vocabulary, in the model's dtype")
_SPEC = ("speculative decoding takes --speculative-config (or --speculative-model and "
         "--num-speculative-tokens) with the methods ngram and draft_model")
_MULTIMODAL = ("images are processed as the model's preprocessor_config.json says, "
               "with no options or cache of their own")
_PLUGINS = "headrace's classes are not pluggable"

FOREIGN_FLAGS = (
    ForeignFlag("task", str, "refused",
                "every model serves completions and /v1/embeddings (see --pooling-type); "
                "classification, scoring, reward and transcription are not supported",
                default="auto", accepted=("generate", "embed", "embedding")),
    ForeignFlag("swap-space", float, "ignored", _RECOMPUTE),
    ForeignFlag("preemption-mode", str, "refused", _RECOMPUTE, accepted=("recompute",)),
    ForeignFlag("use-v2-block-manager", bool, "ignored", "there is one block manager"),
    ForeignFlag("num-scheduler-steps", int, "ignored", _AHEAD),
    ForeignFlag("async-scheduling", bool, "always", _AHEAD),
    ForeignFlag("enable-ssl-refresh", bool, "ignored",
                "the certificate files are read once, when the gateway starts"),
    ForeignFlag("multi-step-stream-outputs", bool, "ignored", _AHEAD),
    ForeignFlag("disable-async-output-proc", bool, "ignored", _AHEAD),
    ForeignFlag("scheduler-delay-factor", float, "ignored",
                "waiting prompts are scheduled as soon as the token budget has room"),
    ForeignFlag("max-seq-len-to-capture", int, "ignored",
                "CUDA graphs capture decode batches of any context length"),
    ForeignFlag("max-parallel-loading-workers", int, "ignored",
                "each tensor-parallel rank loads its own shard"),
    ForeignFlag("disable-log-stats", bool, "ignored",
                "no statistics are logged periodically; /metrics has them"),
    ForeignFlag("enable-reasoning", bool, "ignored", "--reasoning-parser alone turns it on"),
    ForeignFlag("show-hidden-metrics-for-version", str, "ignored", "no metric is hidden"),
    ForeignFlag("tokenizer-pool-size", int, "ignored", _TOKENIZERS),
    ForeignFlag("tokenizer-pool-type", str, "ignored", _TOKENIZERS),
    ForeignFlag("tokenizer-pool-extra-config", str, "ignored", _TOKENIZERS),
    ForeignFlag("disable-mm-preprocessor-cache", bool, "ignored", _MULTIMODAL),
    ForeignFlag("config-format", str, "refused", "configs are read as Hugging Face's",
                default="auto", accepted=("hf",)),
    ForeignFlag("tokenizer-mode", str, "refused", "transformers picks the fast tokenizer",
                default="auto"),
    ForeignFlag("model-impl", str, "refused", "headrace runs its own implementation",
                default="auto", accepted=("vllm",)),
    ForeignFlag("distributed-executor-backend", str, "refused",
                "ranks are processes linked by NCCL", accepted=("mp",)),
    ForeignFlag("revision", str, "refused", _PINNED, accepted=("main",)),
    ForeignFlag("code-revision", str, "refused", _PINNED, accepted=("main",)),
    ForeignFlag("tokenizer-revision", str, "refused", _PINNED, accepted=("main",)),
    ForeignFlag("download-dir", str, "refused", "set HF_HUB_CACHE instead"),
    ForeignFlag("cpu-offload-gb", float, "refused", "weights stay on the GPU", default=0.0),
    ForeignFlag("enable-sleep-mode", bool, "refused", "the worker cannot release its memory"),
    ForeignFlag("enable-expert-parallel", bool, "refused",
                "expert parallelism is not built: every rank holds every expert and "
                "--tensor-parallel-size splits each one"),
    ForeignFlag("lora-dtype", str, "refused", _LORA, default="auto"),
    ForeignFlag("lora-extra-vocab-size", int, "refused", _LORA),
    ForeignFlag("long-lora-scaling-factors", str, "refused", _LORA),
    ForeignFlag("fully-sharded-loras", bool, "refused", _LORA),
    ForeignFlag("enable-lora-bias", bool, "refused", _LORA),
    ForeignFlag("qlora-adapter-name-or-path", str, "refused", _LORA),
    ForeignFlag("enable-prompt-adapter", bool, "refused", "prompt adapters are not supported"),
    ForeignFlag("max-prompt-adapters", int, "refused", "prompt adapters are not supported"),
    ForeignFlag("max-prompt-adapter-token", int, "refused",
                "prompt adapters are not supported"),
    ForeignFlag("speculative-max-model-len", int, "refused", _SPEC),
    ForeignFlag("speculative-draft-tensor-parallel-size", int, "refused", _SPEC),
    ForeignFlag("speculative-model-quantization", str, "refused", _SPEC),
    ForeignFlag("speculative-disable-by-batch-size", int, "refused", _SPEC),
    ForeignFlag("speculative-disable-mqa-scorer", bool, "refused", _SPEC),
    ForeignFlag("spec-decoding-acceptance-method", str, "refused", _SPEC),
    ForeignFlag("typical-acceptance-sampler-posterior-threshold", float, "refused", _SPEC),
    ForeignFlag("typical-acceptance-sampler-posterior-alpha", float, "refused", _SPEC),
    ForeignFlag("disable-logprobs-during-spec-decoding", bool, "refused", _SPEC),
    ForeignFlag("num-lookahead-slots", int, "refused", _SPEC, default=0),
    ForeignFlag("mm-processor-kwargs", str, "refused", _MULTIMODAL),
    ForeignFlag("kv-transfer-config", str, "refused", "KV transfer is not supported"),
    ForeignFlag("worker-cls", str, "refused", _PLUGINS, default="auto"),
    ForeignFlag("worker-extension-cls", str, "refused", _PLUGINS),
    ForeignFlag("scheduler-cls", str, "refused", _PLUGINS),
    ForeignFlag("logits-processor-pattern", str, "refused", "no custom logits processors"),
    ForeignFlag("model-loader-extra-config", str, "refused", _PLUGINS),
    ForeignFlag("additional-config", str, "refused", _PLUGINS),
    ForeignFlag("hf-config-path", str, "refused", "the config is read from the model"),
    ForeignFlag("ignore-patterns", str, "refused", "hub downloads take the safetensors"),
    ForeignFlag("skip-tokenizer-init", bool, "refused", "every stage needs the tokenizer"),
    ForeignFlag("otlp-traces-endpoint", str, "refused",
                "no OpenTelemetry traces: the stage histograms on /metrics time each hop"),
    ForeignFlag("collect-detailed-traces", str, "refused", "no OpenTelemetry traces"),
    ForeignFlag("override-neuron-config", str, "refused", "no Neuron devices"),
    ForeignFlag("ray-workers-use-nsight", bool, "refused", "no Ray workers"),
)
_GROUP = "vLLM flags without a headrace setting"


def add_foreign_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(_GROUP, "accepted so that a vLLM command line runs; "
                                              "each warns or refuses, saying why")
    for flag in FOREIGN_FLAGS:
        dest = _dest(flag)
        if flag.kind is bool:
            group.add_argument("--" + flag.name, dest=dest, default=None,
                               action=argparse.BooleanOptionalAction,
                               help=_help(flag))
        else:
            group.add_argument("--" + flag.name, dest=dest, default=None, type=flag.kind,
                               help=_help(flag))


def foreign_findings(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(a warning for each ignored flag given, the refusal of the first refused flag given
    at a value it cannot take, or None)."""
    warnings = []
    for flag in FOREIGN_FLAGS:
        value = getattr(args, _dest(flag), None)
        if value is None:
            continue
        given = f"--{'no-' if value is False else ''}{flag.name}"
        if flag.fate == "ignored" or flag.fate == "always" and value is False:
            warnings.append(f"{given} has no effect: {flag.why}")
        elif flag.fate == "always":
            warnings.append(f"{given}: always on here, {flag.why}")
        elif value is False:  # a refused switch turned off is vLLM's default
            continue
        elif value != flag.default and value not in flag.accepted:
            shown = "" if flag.kind is bool else f" {value}"
            return warnings, f"--{flag.name}{shown} is not supported: {flag.why}"
    return warnings, None


def _help(flag: ForeignFlag) -> str:
    fate = "always on" if flag.fate == "always" else flag.fate
    return f"{fate}: {flag.why}".replace("%", "%%")


def _dest(flag: ForeignFlag) -> str:
    return "vllm_" + flag.name.replace("-", "_")

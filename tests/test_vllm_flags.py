"""Every flag of the seed's `vllm serve` list parses: headrace implements it, ignores it
with a warning saying why, or refuses a value it cannot honour in one line."""

from __future__ import annotations

import argparse
import logging

import pytest

from common.config import (ConfigError, EngineConfig, add_engine_args, add_server_args,
                           engine_config_from_args)
from common.vllm_flags import FOREIGN_FLAGS

# The serve flags named in ../shared/seeds (vLLM's docs of its serve arguments), as a
# vLLM user passes them.
SEED_SERVE_FLAGS = """
additional-config allowed-local-media-path block-size calculate-kv-scales code-revision
collect-detailed-traces compilation-config config-format cpu-offload-gb device
disable-async-output-proc disable-custom-all-reduce disable-log-stats
disable-logprobs-during-spec-decoding disable-mm-preprocessor-cache disable-sliding-window
distributed-executor-backend download-dir dtype enable-chunked-prefill enable-expert-parallel
enable-lora enable-lora-bias enable-prefix-caching enable-prompt-adapter enable-reasoning
enable-sleep-mode enforce-eager fully-sharded-loras generation-config gpu-memory-utilization
guided-decoding-backend hf-config-path hf-overrides ignore-patterns kv-cache-dtype
kv-transfer-config limit-mm-per-prompt load-format logits-processor-pattern
long-lora-scaling-factors long-prefill-token-threshold lora-dtype lora-extra-vocab-size
max-cpu-loras max-logprobs max-long-partial-prefills max-lora-rank max-loras max-model-len
max-num-batched-tokens max-num-partial-prefills max-num-seqs max-parallel-loading-workers
max-prompt-adapter-token max-prompt-adapters max-seq-len-to-capture mm-processor-kwargs
model model-impl model-loader-extra-config multi-step-stream-outputs ngram-prompt-lookup-max
ngram-prompt-lookup-min num-gpu-blocks-override num-lookahead-slots num-scheduler-steps
num-speculative-tokens otlp-traces-endpoint override-generation-config override-neuron-config
override-pooler-config task
pipeline-parallel-size preemption-mode qlora-adapter-name-or-path quantization
ray-workers-use-nsight reasoning-parser revision rope-scaling rope-theta scheduler-cls
scheduler-delay-factor scheduling-policy seed served-model-name show-hidden-metrics-for-version
skip-tokenizer-init spec-decoding-acceptance-method speculative-disable-by-batch-size
speculative-disable-mqa-scorer speculative-draft-tensor-parallel-size
speculative-max-model-len speculative-model speculative-model-quantization swap-space
tensor-parallel-size tokenizer tokenizer-mode tokenizer-pool-extra-config tokenizer-pool-size
tokenizer-pool-type tokenizer-revision trust-remote-code
typical-acceptance-sampler-posterior-alpha typical-acceptance-sampler-posterior-threshold
use-tqdm-on-load use-v2-block-manager worker-cls worker-extension-cls
""".split()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser, positional_model=True)
    add_server_args(parser)
    return parser


def known_flags() -> set[str]:
    return {option.lstrip("-") for action in parser()._actions
            for option in action.option_strings}


def test_every_seed_serve_flag_is_known():
    assert sorted(set(SEED_SERVE_FLAGS) - known_flags()) == []


def test_each_foreign_flag_is_not_also_a_setting():
    names = [flag.name for flag in FOREIGN_FLAGS]
    assert len(names) == len(set(names))
    settings = {f.replace("_", "-") for f in EngineConfig.__dataclass_fields__}
    assert settings.isdisjoint(names)


def sample_value(kind: type) -> list[str]:
    return {bool: [], int: ["3"], float: ["2.5"], str: ["something"]}[kind]


@pytest.mark.parametrize("flag", FOREIGN_FLAGS, ids=lambda f: f.name)
def test_ignored_flags_warn_and_refused_ones_say_why(flag, caplog):
    args = parser().parse_args(["m", f"--{flag.name}", *sample_value(flag.kind)])
    if flag.fate == "refused":
        with pytest.raises(ConfigError) as info:
            engine_config_from_args(args)
        assert f"--{flag.name}" in str(info.value) and flag.why in str(info.value)
        return
    with caplog.at_level(logging.WARNING, logger="headrace.config"):
        assert engine_config_from_args(args).model == "m"
    assert f"--{flag.name} has no effect: {flag.why}" in caplog.text


@pytest.mark.parametrize("argv", [["--preemption-mode", "recompute"], ["--revision", "main"],
                                  ["--pipeline-parallel-size", "1"], ["--no-enable-lora"],
                                  ["--distributed-executor-backend", "mp"],
                                  ["--tokenizer-mode", "auto"], ["--task", "embed"]])
def test_refused_flags_pass_at_the_values_headrace_honours(argv):
    assert engine_config_from_args(parser().parse_args(["m", *argv])).model == "m"


def test_override_generation_config_is_checked():
    config = engine_config_from_args(parser().parse_args(
        ["m", "--override-generation-config", '{"temperature": 0.5}']))
    assert config.generation_overrides() == {"temperature": 0.5}
    for text in ("{temperature", "[1]"):
        with pytest.raises(ConfigError, match="--override-generation-config"):
            EngineConfig(model="m", override_generation_config=text)


def test_config_overrides_merge_and_are_checked():
    config = engine_config_from_args(parser().parse_args(
        ["m", "--hf-overrides", '{"rope_theta": 1.0, "max_position_embeddings": 64}',
         "--rope-scaling", '{"rope_type": "linear", "factor": 2.0}', "--rope-theta", "5e5"]))
    assert config.hf_config_overrides() == {
        "rope_theta": 5e5, "max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    for field, text in (("hf_overrides", "{x"), ("hf_overrides", "[]"),
                        ("rope_scaling", '"linear"')):
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ConfigError, match=flag):
            EngineConfig(model="m", **{field: text})


def test_pooler_flags_choose_the_embeddings_pooling():
    def pooling(*argv: str) -> tuple[str, bool]:
        return engine_config_from_args(parser().parse_args(["m", *argv])).pooling()

    assert pooling() == ("LAST", True)
    assert pooling("--pooling-type", "MEAN") == ("MEAN", True)
    assert pooling("--override-pooler-config", '{"pooling_type": "MEAN", "normalize": true}'
                   ) == ("MEAN", True)
    assert pooling("--pooling-type", "MEAN", "--pooler-config", '{"normalize": false}'
                   ) == ("MEAN", False)
    assert pooling("--pooler-config", '{"pooling_type": "LAST"}', "--pooling-type", "MEAN"
                   ) == ("LAST", True)  # the JSON object wins, as vLLM's override does
    for text, words in (("{x", "not JSON"), ('{"softmax": true}', "pooling_type, normalize"),
                        ('{"pooling_type": "CLS"}', "['LAST', 'MEAN']"),
                        ('{"normalize": 1}', "true or false")):
        with pytest.raises(ConfigError, match="pool") as info:
            EngineConfig(model="m", override_pooler_config=text)
        assert words in str(info.value)
    with pytest.raises(ConfigError, match="--task classify is not supported"):
        engine_config_from_args(parser().parse_args(["m", "--task", "classify"]))

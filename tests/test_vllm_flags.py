"""Every flag of the seed's `vllm serve` list parses: headrace implements it, ignores it
with a warning saying why, or refuses a value it cannot honour in one line."""

from __future__ import annotations

import argparse
import logging

import pytest

from common.config import (ConfigError, EngineConfig, ServerConfig, add_engine_args,
                           add_server_args, engine_args_to_cli, engine_config_from_args,
                           server_args_to_cli, server_config_from_args)
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
    said = "has no effect:" if flag.fate == "ignored" else ": always on here,"
    assert f"--{flag.name}{' ' if flag.fate == 'ignored' else ''}{said} {flag.why}" \
        in caplog.text


@pytest.mark.parametrize("flag", [f for f in FOREIGN_FLAGS
                                  if f.kind is bool and f.fate != "refused"],
                         ids=lambda f: f.name)
def test_the_no_form_of_a_switch_without_effect_warns_as_the_switch_does(flag, caplog):
    with caplog.at_level(logging.WARNING, logger="headrace.config"):
        engine_config_from_args(parser().parse_args(["m", f"--no-{flag.name}"]))
    assert f"--no-{flag.name} has no effect: {flag.why}" in caplog.text


# The flags of issue 33 that vLLM launch scripts carry (--tool-parser-plugin is the tool
# parsers' own change)
ISSUE_33_FLAGS = """
disable-log-requests uvicorn-log-level allowed-origins allowed-methods allowed-headers
allow-credentials ssl-keyfile ssl-certfile ssl-ca-certs ssl-cert-reqs root-path
disable-uvicorn-access-log enable-log-requests
return-tokens-as-token-ids enable-prompt-tokens-details kv-cache-memory-bytes
async-scheduling compilation-config O
""".split()


def test_every_issue_33_flag_is_known():
    assert sorted(set(ISSUE_33_FLAGS) - known_flags()) == []


def test_every_issue_33_flag_says_in_help_what_it_does_here():
    """--help tells what each does here: a setting's own help, or how far it is honoured
    (--async-scheduling: always on, since the scheduler always plans ahead)."""
    helps = {option.lstrip("-"): action.help for action in parser()._actions
             for option in action.option_strings}
    assert [flag for flag in ISSUE_33_FLAGS if len(helps[flag] or "") < 20] == []
    assert helps["async-scheduling"].startswith("always on: the scheduler always plans")
    assert "CUDA graphs" in helps["compilation-config"] and "CUDA graphs" in helps["O"]


@pytest.mark.parametrize("argv, graphs", [
    (["-O3"], True), (["-O", "0"], False), (["-O0"], False), (["-O.level=0"], False),
    (["-O.mode=3"], True), (["-O=3"], True), (["--compilation-config", '{"level": 3}'], True),
    (["--compilation-config", '{"level": 3, "cudagraph_mode": "NONE"}'], False),
    (["-O3", "--enforce-eager"], False)])
def test_compilation_levels_map_to_cuda_graphs_and_say_so(argv, graphs, caplog):
    with caplog.at_level(logging.WARNING, logger="headrace.config"):
        config = engine_config_from_args(parser().parse_args(["m", *argv]))
    assert config.enforce_eager is not graphs
    assert "no torch.compile here; CUDA graphs " + ("on" if graphs else "off") in caplog.text
    again = engine_config_from_args(parser().parse_args(["m", *engine_args_to_cli(config)]))
    assert again.enforce_eager is not graphs  # a child process gets the same


def test_compilation_config_keys_without_effect_are_named_and_bad_levels_refused(caplog):
    with caplog.at_level(logging.WARNING, logger="headrace.config"):
        engine_config_from_args(parser().parse_args(
            ["m", "-O", '{"level": 3, "cudagraph_capture_sizes": [1, 2]}']))
    assert "no effect: cudagraph_capture_sizes" in caplog.text
    for bad in ("7", '{"level": "high"}', "[3]"):
        with pytest.raises(ConfigError, match="--compilation-config"):
            EngineConfig(model="m", compilation_config=bad)


def test_speculative_model_is_the_draft_model_or_ngram_and_refusals_name_both():
    draft = engine_config_from_args(parser().parse_args(
        ["m", "--speculative-model", "/drafts/small", "--num-speculative-tokens", "4"]))
    spec = draft.speculative()
    assert spec is not None and spec.uses_draft_model
    assert (spec.model, spec.num_speculative_tokens) == ("/drafts/small", 4)
    ngram = engine_config_from_args(parser().parse_args(
        ["m", "--speculative-model", "[ngram]", "--num-speculative-tokens", "2",
         "--ngram-prompt-lookup-max", "3"])).speculative()
    assert ngram is not None and (ngram.method, ngram.prompt_lookup_max) == ("ngram", 3)
    with pytest.raises(ConfigError) as info:
        engine_config_from_args(parser().parse_args(["m", "--speculative-max-model-len", "9"]))
    assert "ngram and draft_model" in str(info.value)


def test_kv_cache_memory_bytes_is_vllms_name_of_kv_cache_memory():
    config = engine_config_from_args(parser().parse_args(
        ["m", "--kv-cache-memory-bytes", str(3 << 20)]))
    assert config.kv_cache_memory == 3 << 20


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


def test_the_offline_llm_may_give_the_compilation_level_as_vllm_does():
    assert EngineConfig(model="m", compilation_config=0).enforce_eager
    assert not EngineConfig(model="m", compilation_config={"level": 3}).enforce_eager


def test_server_options_parse_as_vllm_spells_them():
    args = parser().parse_args(["m", "--allowed-origins", '["https://a.example", "https://b"]',
                                "--allowed-methods", "GET", "POST", "--root-path", "/llm/"])
    server = server_config_from_args(args)
    assert server.allowed_origins == ["https://a.example", "https://b"]
    assert server.allowed_methods == ["GET", "POST"] and server.allowed_headers == ["*"]
    assert server.root_path == "/llm" and server.scheme == "http"
    again = server_config_from_args(parser().parse_args(["m", *server_args_to_cli(server)]))
    assert again == server  # what the launcher hands its children
    nobody = ServerConfig(allowed_origins=["[]"])
    assert server_config_from_args(parser().parse_args(
        ["m", *server_args_to_cli(nobody)])).allowed_origins == []
    for bad, words in (({"ssl_keyfile": "k.pem"}, "go together"),
                       ({"ssl_cert_reqs": 2}, "need --ssl-keyfile"),
                       ({"ssl_keyfile": "k", "ssl_certfile": "c", "ssl_cert_reqs": 3},
                        r"0 \(none\)"),
                       ({"allowed_origins": ['["a", 1]']}, "JSON list of strings"),
                       ({"root_path": "llm"}, "must start with /"),
                       ({"uvicorn_log_level": "loud"}, "--uvicorn-log-level")):
        with pytest.raises(ConfigError, match=words):
            ServerConfig(**bad)
    assert ServerConfig(ssl_keyfile="k", ssl_certfile="c").scheme == "https"

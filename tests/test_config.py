"""Settings: vLLM's flag names on every entry point, environment overrides under the command
line, and a clear error (flag, value, what is allowed) for every invalid value."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from common.config import (ConfigError, EngineConfig, ServerConfig, add_engine_args,
                           config_from_args,
                           add_server_args, engine_args_to_cli, engine_config_from_args,
                           server_args_to_cli, server_config_from_args, stage_counts)
from common.model_files import read_chat_template
from services.demo import demo_model_path
from tests.conftest import REPO, repo_env


def parse(argv: list[str]) -> tuple[EngineConfig, ServerConfig]:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, positional_model=True)
    add_server_args(parser)
    args = parser.parse_args(argv)
    return engine_config_from_args(args), server_config_from_args(args)


@pytest.mark.parametrize("argv, words", [
    (["--block-size", "7"], ["--block-size", "7", "16"]),
    (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "1.5", "(0, 1]"]),
    (["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "(0, 1]"]),
    (["--max-num-seqs", "0"], ["max-num-seqs", "0"]),
    (["--tensor-parallel-size", "-2"], ["tensor-parallel-size", "-2"]),
    (["--max-model-len", "0"], ["max-model-len", "0"]),
    (["--num-gpu-blocks-override", "-1"], ["num-gpu-blocks-override", "-1"]),
    (["--max-num-batched-tokens", "8", "--max-num-seqs", "16"],
     ["--max-num-batched-tokens (8)", "--max-num-seqs (16)"]),
    (["--max-num-batched-tokens", "512", "--max-model-len", "2048",
      "--no-enable-chunked-prefill"], ["512", "2048", "chunked prefill"]),
    (["--port", "70000"], ["--port", "70000"]),
    (["--detokenizer-replicas", "0"], ["detokenizer-replicas", "0"]),
    (["--redis-url", "localhost:6379"], ["--redis-url", "localhost:6379", "redis+cluster://"]),
    (["--redis-url", "redis+cluster://h1:7000,h2"], ["--redis-url", "'h2'", "HOST:PORT"]),
    (["--max-num-partial-prefills", "0"], ["--max-num-partial-prefills", "0"]),
    (["--max-long-partial-prefills", "3", "--max-num-partial-prefills", "2"],
     ["--max-long-partial-prefills (3)", "--max-num-partial-prefills (2)"]),
    (["--long-prefill-token-threshold", "-5"], ["--long-prefill-token-threshold", "-5"]),
    (["--long-prefill-token-threshold", "64", "--no-enable-chunked-prefill"],
     ["--long-prefill-token-threshold", "chunked prefill"]),
])
def test_every_invalid_value_names_the_flag_and_the_value(argv, words):
    with pytest.raises(ConfigError) as info:
        parse(["some-model", *argv])
    for word in words:
        assert word in str(info.value)


def test_choices_are_enforced_by_the_parser(capsys):
    for argv in (["--dtype", "int3"], ["--load-format", "pickle"],
                 ["--scheduling-policy", "random"]):
        with pytest.raises(SystemExit):
            parse(["m", *argv])
        assert "invalid choice" in capsys.readouterr().err


def test_a_model_is_required():
    with pytest.raises(ConfigError, match="a model is required"):
        parse([])


def test_positional_and_flag_model_and_vllm_names():
    engine, server = parse(["org/model", "--max-model-len", "1024", "--block-size", "32",
                            "--enable-prefix-caching", "--served-model-name", "a", "b",
                            "--tokenizer-replicas", "3", "--disable-custom-all-reduce"])
    assert engine.model == "org/model" and engine.max_model_len == 1024
    assert engine.disable_custom_all_reduce
    assert engine.block_size == 32 and engine.enable_prefix_caching
    assert server.served_model_name == ["a", "b"] and server.tokenizer_replicas == 3
    assert parse(["--model", "m2"])[0].model == "m2"


def test_environment_overrides_defaults_and_the_command_line_overrides_both(monkeypatch):
    monkeypatch.setenv("HEADRACE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("HEADRACE_ENFORCE_EAGER", "true")
    monkeypatch.setenv("REDIS_URL", "redis://example:6380/0")
    engine, server = parse(["m"])
    assert engine.max_num_seqs == 8 and engine.enforce_eager
    assert server.redis_url == "redis://example:6380/0"
    engine, _ = parse(["m", "--max-num-seqs", "4", "--no-enforce-eager"])
    assert engine.max_num_seqs == 4 and not engine.enforce_eager


def test_a_malformed_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HEADRACE_MAX_NUM_SEQS", "many")
    with pytest.raises(ConfigError, match="HEADRACE_MAX_NUM_SEQS='many'"):
        parse(["m"])


def test_resolved_fills_model_defaults_and_refuses_a_longer_max_model_len():
    config = EngineConfig(model="m").resolved(4096)
    assert config.max_model_len == 4096 and config.max_num_batched_tokens == 8192
    with pytest.raises(ConfigError, match="--max-model-len 8192 is longer than the model's "
                                          "4096 positions"):
        EngineConfig(model="m", max_model_len=8192).resolved(4096)


def test_partial_prefills_take_vllms_default_threshold():
    config = EngineConfig(model="m", max_num_partial_prefills=4).resolved(4096)
    assert config.long_prefill_token_threshold == 163  # 4% of the context
    assert EngineConfig(model="m").resolved(4096).long_prefill_token_threshold == 0
    given = EngineConfig(model="m", max_num_partial_prefills=2, long_prefill_token_threshold=9)
    assert given.resolved(4096).long_prefill_token_threshold == 9


def test_configs_travel_to_child_processes_as_flags():
    engine = EngineConfig(model="m", block_size=32, enforce_eager=True, max_num_seqs=7)
    server = ServerConfig(served_model_name=["x"], detokenizer_replicas=2)
    rebuilt = parse([*engine_args_to_cli(engine), *server_args_to_cli(server)])
    assert rebuilt == (engine, server)


@pytest.mark.parametrize("cores, shards, gateways, tokenizers, detokenizers", [
    (1, 1, 1, 1, 1), (2, 1, 1, 1, 1), (4, 1, 1, 1, 1),  # CI boxes: one of each, as before
    (8, 1, 1, 1, 1), (12, 1, 3, 1, 1),
    (16, 1, 4, 2, 2),  # a GPU host: the layout issue 31 measured at 1.5x one of each
    (16, 4, 2, 1, 1), (32, 1, 8, 4, 4), (64, 1, 8, 4, 4), (128, 8, 8, 4, 4)])
def test_stage_counts_grow_with_the_cores_left_after_the_shards(
        cores, shards, gateways, tokenizers, detokenizers):
    assert stage_counts(cores, shards) == {"api_server_count": gateways,
                                           "tokenizer_replicas": tokenizers,
                                           "detokenizer_replicas": detokenizers}
    counts = stage_counts(cores, shards)
    assert sum(counts.values()) + 1 + 2 * shards <= max(cores, 6)  # no host oversubscribed


def test_stage_flags_given_win_over_the_cores():
    _, server = parse(["m", "--tokenizer-replicas", "3"])
    assert (server.tokenizer_replicas, server.api_server_count) == (3, None)
    sized = server.sized(16)
    assert (sized.api_server_count, sized.tokenizer_replicas, sized.detokenizer_replicas) \
        == (4, 3, 2)
    assert server.sized(2) == ServerConfig(tokenizer_replicas=3, api_server_count=1,
                                           detokenizer_replicas=1)
    assert "--api-server-count 4" in " ".join(server_args_to_cli(sized))  # to the children
    with pytest.raises(ConfigError, match="--detokenizer-replicas must be positive"):
        ServerConfig(detokenizer_replicas=0)


def test_serve_help_says_the_stages_are_sized_from_the_cores():
    out = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--help"], cwd=REPO,
                         env=repo_env(COLUMNS="200"), capture_output=True, text=True,
                         timeout=120).stdout
    for flag, rule in (("--api-server-count", "1 per 3 cores left"),
                       ("--tokenizer-replicas", "1 per 6 cores left"),
                       ("--detokenizer-replicas", "sized from the cores")):
        entry = re.search(rf"^ +{flag} [A-Z_]+\s+(.*?)\[env", out, re.MULTILINE | re.DOTALL)
        assert entry is not None, out
        line = " ".join(entry.group(1).split())
        assert "Default for serve: sized from the cores" in line and rule in line, line
    assert "os.sched_getaffinity" in out and "printed at startup" in out


@pytest.mark.parametrize("command, extra", [("serve", []), ("generate", ["--prompt", "hi"])])
def test_a_tensor_parallel_size_that_does_not_split_the_model_is_refused_in_one_line(
        command, extra):
    """SmolLM2-135M has 9 attention heads and 3 KV heads: two ranks cannot share them."""
    bad = subprocess.run([sys.executable, "-m", "services.cli", command, "--model",
                          demo_model_path(), "--tensor-parallel-size", "2", *extra], cwd=REPO, env=repo_env(),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "--tensor-parallel-size 2 does not split the model evenly: its 9 attention heads and "
        "1536 MLP features must divide by 2, and its 3 KV heads must divide by 2 or into it")
    assert "Traceback" not in bad.stderr


def test_the_offline_engine_refuses_it_too():
    from services import LLM
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 does not split"):
        LLM(demo_model_path(), tensor_parallel_size=2)


def test_tool_and_reasoning_parsers_are_checked():
    assert ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match="--reasoning-parser"):
        ServerConfig(reasoning_parser="o1")


def test_vllm_model_flags_parse(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    args = parser.parse_args(["--chat-template", str(template), "--trust-remote-code",
                              "--kv-cache-dtype", "auto"])
    config = config_from_args(EngineConfig, args)
    assert config.trust_remote_code and config.kv_cache_dtype == "auto"
    assert read_chat_template(config.chat_template) == "{{ messages[0].content }}"
    assert read_chat_template("{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ValueError, match="neither a file nor a template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_lora_settings_are_checked():
    config = EngineConfig(model="m", enable_lora=True, max_loras=3, max_lora_rank=8)
    assert (config.max_loras, config.max_lora_rank, config.cpu_loras) == (3, 8, 3)
    assert EngineConfig(model="m", max_loras=2, max_cpu_loras=5).cpu_loras == 5
    with pytest.raises(ConfigError, match="--max-cpu-loras .2. must be at least --max-loras"):
        EngineConfig(model="m", max_loras=3, max_cpu_loras=2)
    for name in ("max_loras", "max_lora_rank"):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be"):
            EngineConfig(model="m", **{name: 0})
    # adapters shard across ranks as the projections do (tests/test_lora.py)
    assert EngineConfig(model="m", enable_lora=True, tensor_parallel_size=2).enable_lora

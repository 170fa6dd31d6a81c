"""The throughput and latency benchmarks: workloads, their warm-up twins, floor arithmetic,
and both commands end to end on a tiny model (CPU), including the serving paths through
real processes, from the bus and through the HTTP gateway."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import pytest
import torch

from benchmarks.bench.latency_profile import covered_us
from benchmarks.bench.throughput import completion_body, parse_paths, with_sampling
from benchmarks.bench.workloads import (WARMUP_OUTPUT_LEN, WARMUP_SEED, ModelShape, Trace,
                                        fixed_workload, nano_workload, warmup_twin,
                                        with_output_len)
from common.messages import StepPlan
from tests.conftest import run_command
from tests.tiny_models import make_tiny_model

SHAPE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, weight_bytes=1000,
                   num_params=500, kv_value_bytes=2)


def test_nano_workload_is_the_published_one():
    workload = nano_workload()
    assert len(workload.prompts) == 256
    assert workload.output_tokens == 133_966
    assert sum(map(len, workload.prompts)) == 142_827
    assert all(0 <= t <= 10_000 for p in workload.prompts for t in p)
    assert {p.temperature for p in workload.params} == {0.6}
    assert all(p.ignore_eos for p in workload.params)
    subset = with_output_len(workload, 8, 512)
    assert len(subset.prompts) == 8 and subset.output_tokens == 8 * 512


def test_fixed_workload_respects_the_vocabulary():
    workload = fixed_workload("f", 3, prompt_len=50, output_len=7, vocab_size=100)
    assert all(len(p) == 50 and max(p) < 100 for p in workload.prompts)
    assert workload.output_tokens == 21


@pytest.mark.parametrize("workload", [nano_workload(),
                                      fixed_workload("f", 64, 1000, 1000, vocab_size=300)],
                         ids=["nano", "fixed-small-vocab"])
def test_warmup_twin_has_the_shapes_but_not_the_prompts(workload):
    twin = warmup_twin(workload, WARMUP_SEED)
    assert [len(p) for p in twin.prompts] == [len(p) for p in workload.prompts]
    assert [p.max_tokens for p in twin.params] == [WARMUP_OUTPUT_LEN] * len(workload.params)
    assert [p.temperature for p in twin.params] == [p.temperature for p in workload.params]
    assert all(0 <= t <= workload.top_token_id for p in twin.prompts for t in p)
    # no warm prompt shares even its first block (16 tokens) with a timed prompt, so the
    # prefix cache holds none of the timed prefills when the timed run starts
    timed_heads = {tuple(p[:16]) for p in workload.prompts}
    assert not any(tuple(p[:16]) in timed_heads for p in twin.prompts)
    assert warmup_twin(workload, WARMUP_SEED).prompts == twin.prompts  # reproducible


def test_path_lists():
    assert parse_paths("inprocess,http") == ["inprocess", "http"]
    assert parse_paths("both") == ["inprocess", "pipeline"]
    assert parse_paths("http, both,http") == ["http", "inprocess", "pipeline"]
    with pytest.raises(argparse.ArgumentTypeError, match="'grpc'"):
        parse_paths("inprocess,grpc")


def test_trace_counts_bytes_and_flops_of_a_step():
    trace = Trace()
    # one decode at position 9 (10 keys) and a 3-token prefill chunk behind 4 cached tokens
    plan = StepPlan(1, ["a", "b"], [1, 3], [9, 4])
    trace.record(plan, SHAPE, waste=0.25)
    kv = SHAPE.kv_bytes_per_token  # 2 * 2 layers * 2 heads * 8 * 2 bytes = 128
    context, new, attended = 10 + 7, 4, 10 + (5 + 6 + 7)
    step = trace.steps[0]
    assert step.bytes == 1000 + context * kv + new * kv
    assert step.flops == 2 * 500 * new + 4 * attended * 8 * 4 * 2
    assert trace.floor_seconds(bandwidth=1e3, matmul_rate=1e12) == pytest.approx(
        step.bytes / 1e3)
    assert trace.mean_waste == 0.25


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench"), "llama")


def run_throughput(model: Path, tmp_path: Path, paths: str, *extra: str
                   ) -> tuple[str, dict]:
    """`headrace bench throughput` of 6 fixed prompts over `paths`: (stdout, its --json)."""
    out = tmp_path / "throughput.json"
    result = run_command("bench", "throughput", "--model", str(model), "--workload", "fixed",
                         "--num-prompts", "6", "--prompt-len", "20", "--output-len", "12",
                         "--path", paths, "--num-gpu-blocks-override", "128",
                         "--json", str(out), *extra, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, json.loads(out.read_text())


@pytest.fixture(scope="module")
def both_paths(tiny, tmp_path_factory) -> tuple[str, dict]:
    """One rank's run over both paths, read by the tests of both paths and of two ranks."""
    return run_throughput(tiny, tmp_path_factory.mktemp("both"), "both")


def test_throughput_command_times_both_paths(both_paths):
    stdout, data = both_paths
    assert "pipeline / inprocess: " in stdout
    assert [r["path"] for r in data["results"]] == ["inprocess", "pipeline"]
    assert all(r["output_tokens"] == 6 * 12 for r in data["results"])
    assert data["floor_seconds"] > 0 and 0 <= data["kv_waste_mean"] < 1
    inprocess, pipeline = (r["phases"] for r in data["results"])
    assert inprocess["loops"] > 12 and inprocess["execute_s"] > 0  # the engine's own clock
    # the services' loop clocks, logged when they stopped: warm-up and timed run, so at
    # least one loop per output token's step
    assert pipeline["worker.loops"] >= 12 and pipeline["worker.submit_s"] > 0
    assert pipeline["scheduler.loops"] >= 12 and pipeline["scheduler.update_s"] > 0


def test_throughput_command_runs_two_ranks_on_both_paths(tiny, tmp_path, both_paths):
    """The in-process engine lets its ranks go before the pipeline's worker starts its
    own; the floor is one rank's share."""
    _, one = both_paths
    _, data = run_throughput(tiny, tmp_path, "both", "--tensor-parallel-size", "2",
                             "--device", "cpu")
    assert [r["path"] for r in data["results"]] == ["inprocess", "pipeline"]
    assert all(r["output_tokens"] == 6 * 12 for r in data["results"])
    assert 0 < data["floor_seconds"] < one["floor_seconds"]


def test_sampling_options_reach_every_request_and_the_workloads_name():
    workload = with_sampling(nano_workload(4), logprobs=1, top_p=0.9)
    assert workload.name == "nano[logprobs=1,top_p=0.9]"
    assert all(p.logprobs == 1 and p.top_p == 0.9 for p in workload.params)
    assert completion_body("m", [1, 2], workload.params[0])["logprobs"] == 1
    assert "logprobs" not in completion_body("m", [1, 2], nano_workload(1).params[0])
    assert with_sampling(workload, logprobs=None, top_p=None) is workload
    twins = with_sampling(nano_workload(4), temperature=0.0, n=4)
    assert twins.name == "nano[temperature=0.0,n=4]"
    assert twins.output_tokens == 4 * nano_workload(4).output_tokens
    assert completion_body("m", [1], twins.params[0])["n"] == 4
    assert "n" not in completion_body("m", [1], workload.params[0])


def test_throughput_command_times_the_http_path(tiny, tmp_path):
    """With logprobs and two greedy completions a request asked for on both paths, as the
    detokenizer-bound workload of stage_scaling.sh does."""
    stdout, data = run_throughput(tiny, tmp_path, "inprocess,http", "--logprobs", "1",
                                  "--n", "2", "--temperature", "0")
    assert {r["workload"] for r in data["results"]} == {
        "fixed[logprobs=1,temperature=0.0,n=2]"}
    assert [r["path"] for r in data["results"]] == ["inprocess", "http"]
    assert all(r["output_tokens"] == 6 * 12 * 2 and r["requests"] == 6
               for r in data["results"])
    inprocess, http = data["results"]
    ratio = http["tokens_per_s"] / inprocess["tokens_per_s"]
    assert f"http / inprocess: {ratio:.2f}x" in stdout.splitlines()
    over_http = inprocess["tokens_per_s"] / http["tokens_per_s"]
    assert f"inprocess / http: {over_http:.2f}x (goal: 0.97x or more)" in stdout.splitlines()
    # the gateway drove the same services: their loop clocks ran the warm-up and the run
    assert http["phases"]["worker.loops"] >= 12 and http["phases"]["scheduler.loops"] >= 12


def test_throughput_command_compares_two_shards_with_one(tiny, tmp_path):
    stdout, data = run_throughput(tiny, tmp_path, "pipeline", "--data-parallel-size", "2",
                                  "--compare-data-parallel", "--device", "cpu")
    runs = [(r["path"], r["data_parallel_size"]) for r in data["results"]]
    assert runs == [("inprocess", 1), ("pipeline", 1), ("pipeline", 2)]
    assert all(r["output_tokens"] == 6 * 12 for r in data["results"])
    _, one, two = data["results"]
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    assert f"pipeline dp=2 / pipeline: {ratio:.2f}x" in stdout.splitlines()


def run_latency(model: Path, out: Path, *extra: str) -> dict:
    """`headrace bench latency` of a 32-token context on the CPU: its --json."""
    result = run_command("bench", "latency", "--model", str(model), "--context-len", "32",
                         "--iterations", "1", "--num-gpu-blocks-override", "64",
                         "--json", str(out), "--device", "cpu", *extra, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_rank_latency(tiny, tmp_path_factory) -> dict:
    """One rank's latency run, read by the decode-time and the floor tests."""
    out = tmp_path_factory.mktemp("latency") / "latency.json"
    return run_latency(tiny, out, "--output-len", "8", "--tensor-parallel-size", "1")


@pytest.mark.parametrize("tp", ["1", "2"])
def test_latency_command_reports_decode_time(tiny, tmp_path, tp, one_rank_latency):
    data = one_rank_latency if tp == "1" else run_latency(
        tiny, tmp_path / "latency.json", "--output-len", "8", "--tensor-parallel-size", tp)
    assert data["decode_ms_per_token_median"] > 0 and data["prefill_ms"] > 0
    assert data["floor_ms_per_token"] > 0 and data["draft_tokens"] == 0
    assert data["decode_tokens_per_s"] > 0


def test_latency_command_times_steps_with_logprobs(tiny, tmp_path):
    """--logprobs N: every request asks for them, and the run checks that each token came
    back with its logprobs."""
    data = run_latency(tiny, tmp_path / "latency.json", "--output-len", "8", "--logprobs", "1")
    assert data["logprobs"] == 1 and data["decode_ms_per_token_median"] > 0


def test_latency_command_speculates_on_a_repeating_prompt(tiny, tmp_path):
    """--prompt-period makes the prompt repeat, so ngram speculation always finds drafts;
    the timed iterations' drafts and acceptances are reported (none without it)."""
    out = tmp_path / "latency.json"
    spec = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
            '"prompt_lookup_min": 1}')
    result = run_command("bench", "latency", "--model", str(tiny), "--context-len", "32",
                         "--output-len", "48", "--iterations", "1", "--prompt-period", "4",
                         "--speculative-config", spec, "--num-gpu-blocks-override", "64",
                         "--json", str(out), "--device", "cpu", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["draft_tokens"] > 0 and 0 <= data["accepted_draft_tokens"] <= data["draft_tokens"]
    assert f"of {data['draft_tokens']} draft tokens accepted" in result.stdout


def test_random_adapters_are_peft_adapters_the_engine_serves(tiny, tmp_path):
    """The benchmark's hand-written adapters load in PEFT, and a batch mixing two of them
    with the base model equals PEFT's merged weights: the files are what they claim."""
    from transformers import AutoConfig

    from common.sampling_params import SamplingParams
    from services import LLM
    from benchmarks.bench.adapters import random_adapters
    from tests.test_lora import MAX_TOKENS, merged_greedy

    adapters = random_adapters(AutoConfig.from_pretrained(tiny), 2, 8, tmp_path,
                               dtype=torch.float32)
    prompts = [[5, 9, 14, 3, 22], [7, 7, 31], [40, 2, 18, 6]]
    loras = [*adapters, None]
    llm = LLM(str(tiny), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks_override=64, block_size=4)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True),
                           use_tqdm=False, lora_request=loras)
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [merged_greedy(tiny, None if lora is None else lora.lora_path, prompt)
                   for prompt, lora in zip(prompts, loras)]
    assert got[:2] != [merged_greedy(tiny, None, prompt) for prompt in prompts[:2]]


def test_latency_command_refuses_outputs_too_short_to_time(tiny):
    """Four tokens all come back with the last launched steps' drain: every decode gap
    would read 0 (a division by zero once), so the command says what it needs."""
    refused = run_command("bench", "latency", "--model", str(tiny), "--context-len", "16",
                          "--output-len", "4", "--device", "cpu", timeout=300)
    assert refused.returncode == 2
    assert "--output-len 4: at least 6" in refused.stderr, refused.stderr[-2000:]


def test_latency_command_decodes_under_lora_adapters(tiny, tmp_path):
    out = tmp_path / "latency.json"
    common = ["bench", "latency", "--model", str(tiny), "--context-len", "16",
              "--output-len", "8", "--iterations", "1", "--batch-size", "4",
              "--num-gpu-blocks-override", "64", "--device", "cpu", "--lora-adapters", "2"]
    refused = run_command(*common, timeout=300)
    assert refused.returncode == 2 and "needs --enable-lora" in refused.stderr
    result = run_command(*common, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                         "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["lora_adapters"] == 2
    assert "2 LoRA adapters" in result.stdout


def test_the_copy_model_continues_the_latency_prompts_cycle(tmp_path):
    """benchmarks/gpu/copy_model.py: its greedy continuation of the repeating prompt is the
    prompt's own cycle, so ngram speculation accepts every draft."""
    import subprocess
    import sys

    from common.sampling_params import SamplingParams
    from services import LLM
    from benchmarks.bench.latency import repeated
    from tests.conftest import repo_env

    config_dir = make_tiny_model(tmp_path, "llama", tie_word_embeddings=False)
    out = tmp_path / "copy"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "copy_model.py"
    done = subprocess.run([sys.executable, str(script), "--config-dir", str(config_dir),
                           "--out", str(out), "--context-len", "40", "--prompt-period", "6"],
                          env=repo_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    motif = fixed_workload("latency", 1, 40, 1, vocab_size=512).prompts[0][:6]
    prompt = repeated(motif, 40)
    llm = LLM(str(out), dtype="float32", num_gpu_blocks_override=32, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == repeated(motif, 52)[40:]


def test_latency_floor_counts_quantized_weights(tiny, tmp_path, one_rank_latency):
    """--quantization fp8 (quantized on load) holds a byte per projection weight where
    float32 holds four, plus a float32 scale per output row: the bytes the floor counts
    shrink by exactly that."""
    fp8 = run_latency(tiny, tmp_path / "latency.json", "--output-len", "8", "--load-format",
                      "dummy", "--quantization", "fp8")
    assert fp8["floor_ms_per_token"] > 0
    read = {0: one_rank_latency["weight_bytes"], 2: fp8["weight_bytes"]}
    c = json.loads((tiny / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    h, i = c["hidden_size"], c["intermediate_size"]
    weights = c["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * i)
    rows = c["num_hidden_layers"] * ((q + 2 * kv) + h + 2 * i + h)
    assert read[0] - read[2] == 3 * weights - 4 * rows, read


def test_latency_command_profiles_one_more_batch(tiny, tmp_path):
    """--profile: an untimed batch under torch.profiler, its gzipped Chrome trace in
    --profile-result-dir, and its busiest operators (kernels on a GPU) per output token
    in the JSON, and the busy time within the span of the batch's operators."""
    data = run_latency(tiny, tmp_path / "latency.json", "--output-len", "8", "--profile",
                       "--profile-result-dir", str(tmp_path / "traces"))
    profile = data["profile"]
    trace = Path(profile["trace"])
    assert trace == tmp_path / "traces" / "latency-b1-ctx32.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "aten::mm" or "linear" in e.get("name", "") for e in events)
    assert profile["device"] == "cpu" and profile["output_tokens"] == 8
    top = profile["top"]
    assert 0 < len(top) <= 15 and all(k["calls"] > 0 for k in top)
    assert [k["total_ms"] for k in top] == sorted((k["total_ms"] for k in top), reverse=True)
    assert 0 < profile["busy_ms"] <= profile["span_ms"]
    assert top[0]["us_per_token"] == pytest.approx(1000 * top[0]["total_ms"] / 8)


@pytest.mark.parametrize("spans, covered", [
    ([], 0), ([(0, 10)], 10), ([(0, 10), (20, 25)], 15), ([(0, 10), (5, 12)], 12),
    ([(0, 10), (2, 4), (8, 15), (20, 21)], 16)])
def test_the_busy_time_is_the_union_of_the_spans(spans, covered):
    """PDL kernels overlap the one before them: busy time counts each instant once."""
    assert covered_us(spans) == covered

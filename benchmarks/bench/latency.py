"""`headrace bench latency`: one batch's prefill time and per-token decode latency.

    headrace bench latency --model DIR --load-format dummy --context-len 1000 \\
        [--batch-size 1] [--output-len 128] [--iterations 3] [--logprobs N] [--json FILE] \\
        [--enable-lora --max-loras 4 --max-lora-rank 16 --lora-adapters 4] \\
        [--profile [--profile-result-dir DIR]]

Each iteration prefills `batch-size` prompts of `context-len` tokens and decodes
`output-len` tokens; prefill is the time to the first token, a decode's time the gap
between one request's consecutive tokens (ms per output token). The floor
of a batch-1 decode is the weights plus the KV cache read once, over the copy bandwidth.
With --lora-adapters N, request i decodes under random adapter i mod N of rank
--max-lora-rank over every projection (benchmarks/bench/adapters.py). With --profile one
more batch runs under torch.profiler, untimed (benchmarks/bench/latency_profile.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.bench.adapters import random_adapters
from benchmarks.bench.latency_profile import profile_batch
from benchmarks.bench.throughput import _sync, machine_info
from benchmarks.bench.workloads import ModelShape, fixed_workload, measure_ceilings
from common.config import ConfigError, add_engine_args, engine_config_from_args
from common.log import configure_logging
from common.messages import LoRARequest
from common.sampling_params import SamplingParams
from services.offline.engine import Engine, launch_lag


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace bench latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-len", type=int, default=1000,
                        help="prompt tokens before decoding starts")
    parser.add_argument("--batch-size", type=int, default=1, help="requests decoded together")
    parser.add_argument("--output-len", type=int, default=128, help="tokens decoded")
    parser.add_argument("--iterations", type=int, default=3, help="timed repetitions")
    parser.add_argument("--prompt-period", type=int, default=0,
                        help="each prompt repeats its first N tokens (0: no repetition), "
                             "so that ngram speculative decoding finds drafts; with "
                             "speculation, compare the mean decode time per token")
    parser.add_argument("--lora-adapters", type=int, default=0,
                        help="random LoRA adapters the batch's requests take in turn (0: the "
                             "base model); needs --enable-lora and --max-loras >= N")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="every request also asks for its tokens' logprobs and the top N "
                             "(what a greedy chat with logprobs costs the step)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed iterations, one more batch under torch.profiler:"
                             " its Chrome trace, and its kernels' device time per token")
    parser.add_argument("--profile-result-dir", type=Path,
                        default=Path(os.environ.get("VLLM_TORCH_PROFILER_DIR",
                                                    "headrace_profile")),
                        help="where --profile writes its trace [env VLLM_TORCH_PROFILER_DIR; "
                             "default ./headrace_profile]")
    parser.add_argument("--json", default=None, help="write the results to this file")
    add_engine_args(parser)
    return parser


def time_one_batch(engine: Engine, prompts: list[list[int]], output_len: int,
                   adapters: Sequence[LoRARequest] = (), logprobs: int | None = None
                   ) -> tuple[float, list[float]]:
    """(seconds to the first token, seconds between each later token and the one before),
    for the batch's first request. Steps run back to back with no synchronisation of our
    own, as in serving: the engine launches a step before the previous one's tokens are
    back, so the gap between tokens is what a streaming client sees."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len,
                            logprobs=logprobs)
    run_id = uuid.uuid4().hex[:6]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{run_id}-{i}", prompt, params,
                           lora=adapters[i % len(adapters)] if adapters else None)
    first = f"{run_id}-0"
    _sync(engine.runner.device)
    start = time.perf_counter()
    arrivals: list[float] = []
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        mine = [d for d in deltas if d.rid == first]
        arrivals += [now] * sum(len(d.token_ids) for d in mine)
        if logprobs is not None and any(len(d.logprobs) != len(d.token_ids) for d in mine):
            raise RuntimeError("a step's tokens came back without their logprobs")
    return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])]


def repeated(motif: list[int], length: int) -> list[int]:
    return (motif * -(-length // len(motif)))[:length]


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    if args.lora_adapters and not (config.enable_lora
                                   and config.max_loras >= args.lora_adapters):
        parser.error(f"--lora-adapters {args.lora_adapters} needs --enable-lora and "
                     f"--max-loras >= {args.lora_adapters} (one step holds them all)")
    # the last steps launched come back together once nothing is left to plan, so a
    # batch's decode gaps are all 0 unless it outlasts them
    if args.output_len < (shortest := 2 * launch_lag(config)):
        parser.error(f"--output-len {args.output_len}: at least {shortest}, twice the "
                     "steps the engine keeps launched, so that tokens come back apart")
    configure_logging("bench")
    # run() inspects its model. Each step's text is made in the loop, so that a token's
    # arrival is when its step's tokens were applied: from the detokenizer process, texts
    # come back in bunches whenever it falls behind (a loaded CPU), and a median of gaps
    # then reads 0
    engine = Engine(config, detokenizer_process=False, worker_process=False)
    try:
        with tempfile.TemporaryDirectory(prefix="headrace-adapters-") as root:
            return run(args, argv, engine, Path(root))
    finally:
        # its threads and ranks go before the interpreter does: left to exit, the process
        # aborted there now and then ("terminate called without an active exception")
        engine.close()


def run(args: argparse.Namespace, argv: list[str], engine: Engine, adapter_root: Path
        ) -> int:
    adapters = random_adapters(engine.runner.hf_config, args.lora_adapters,
                               engine.config.max_lora_rank, adapter_root,
                               engine.runner.dtype)
    prompts = fixed_workload("latency", args.batch_size, args.context_len, 1,
                             vocab_size=engine.runner.model.vocab_size).prompts
    if args.prompt_period > 0:
        prompts = [repeated(p[:args.prompt_period], args.context_len) for p in prompts]
    # warm-up: compiles, graphs, adapters
    time_one_batch(engine, prompts, 4, adapters, args.logprobs)
    prefills, decodes = [], []
    spec = engine.scheduler.spec  # the timed iterations' share of its counters
    drafted, accepted = -spec.num_draft_tokens, -spec.num_accepted_tokens
    for _ in range(args.iterations):
        prefill, steps = time_one_batch(engine, prompts, args.output_len, adapters,
                                        args.logprobs)
        prefills.append(prefill)
        decodes += steps
    drafted += spec.num_draft_tokens
    accepted += spec.num_accepted_tokens
    shape = ModelShape.of(engine.runner.model, engine.runner.hf_config,
                          engine.config.tensor_parallel_size,
                          engine.runner.kv_caches[0][0].element_size())
    ceilings = measure_ceilings(engine.runner.device)
    context = args.context_len + args.output_len / 2
    floor_s = (shape.weight_bytes + shape.decode_expert_bytes(args.batch_size)
               + args.batch_size * context * shape.kv_bytes_per_token) \
        / ceilings.copy_bytes_per_s
    ms = [1000 * s for s in decodes]
    result = {"command": "headrace bench latency " + " ".join(argv),
              "machine": machine_info(engine.runner.device),
              "batch_size": args.batch_size, "context_len": args.context_len,
              "prefill_ms": 1000 * statistics.median(prefills),
              "decode_ms_per_token_median": statistics.median(ms),
              "decode_ms_per_token_mean": statistics.fmean(ms),
              "decode_ms_per_token_p90": sorted(ms)[int(0.9 * (len(ms) - 1))],
              # the batch's decode rate; the mean, since speculation delivers tokens in bursts
              "decode_tokens_per_s": args.batch_size * 1000 / statistics.fmean(ms),
              "floor_ms_per_token": 1000 * floor_s,
              # what the floor reads each step besides the KV cache (quantized: fewer)
              "weight_bytes": shape.weight_bytes + shape.decode_expert_bytes(args.batch_size),
              "copy_bandwidth_tb_s": ceilings.copy_bytes_per_s / 1e12,
              "draft_tokens": drafted, "accepted_draft_tokens": accepted,
              "lora_adapters": len(adapters), "logprobs": args.logprobs}
    print(f"{result['machine']['device']}: batch {args.batch_size}, context "
          f"{args.context_len}: prefill {result['prefill_ms']:.1f} ms; decode "
          f"{result['decode_ms_per_token_median']:.3f} ms/token median "
          f"(mean {result['decode_ms_per_token_mean']:.3f}, p90 "
          f"{result['decode_ms_per_token_p90']:.3f}); floor {result['floor_ms_per_token']:.3f}"
          f" ms/token ({result['floor_ms_per_token'] / result['decode_ms_per_token_mean']:.0%}"
          f" of it achieved); {result['decode_tokens_per_s']:.1f} tokens/s" + (f"; {accepted} of {drafted} draft tokens accepted"
                                 if drafted else "")
          + (f"; {len(adapters)} LoRA adapters" if adapters else "")
          + (f"; logprobs={args.logprobs}" if args.logprobs is not None else ""))
    if args.profile:
        summary = profile_batch(
            lambda: time_one_batch(engine, prompts, args.output_len, adapters, args.logprobs),
            engine.runner.device, args.profile_result_dir,
            f"latency-b{args.batch_size}-ctx{args.context_len}")
        print("\n".join(summary.lines()))
        result["profile"] = dataclasses.asdict(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return 0

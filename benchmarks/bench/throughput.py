"""`headrace bench throughput`: offline generation throughput against the workload's floor.

    headrace bench throughput --model DIR --load-format dummy --workload nano \\
        [--path inprocess[,pipeline][,http]] [--compare transformers] [--json FILE]

Workloads: `nano` (256 requests, prompt and output lengths uniform in [100, 1024], seed 0,
133,966 output tokens), `8b` (64 requests of 1000-token prompts and 1000 output tokens) and
`fixed` (--num-prompts of --prompt-len tokens and --output-len outputs). `inprocess` runs
LLM's engine from this process (its executor in a worker process where LLM's is: on
GPUs, unless HEADRACE_WORKER_PROCESS=0); `pipeline` runs the same
workload through the Redis-linked worker, scheduler, tokenizer and detokenizer processes;
`http` through all of those and the gateway (what `headrace serve` runs), as streamed
/v1/completions requests sent at once. So the cost of each serving layer is measured, not
guessed: the report gives each path's throughput as a ratio of the in-process one (`both`
means inprocess,pipeline). Every path warms up first on other prompts of the same lengths,
so that the timed prompts are not in the prefix cache. `--compare transformers` runs
transformers' generate_batch on the same weights and prompts (a subset, at one fixed output
length, since it cannot take a length per request) and the same for ours, and prints the
ratio. The served paths run `--data-parallel-size` shards (the in-process engine is always
one); with `--compare-data-parallel` each served path also runs with one shard, in the same
command, and the report gives the ratio of the shards' throughput to the one's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import platform
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import torch

from benchmarks.bench.pipeline import CLIENT, LocalPipeline, drive
from benchmarks.bench.serve import (COUNTERS_SETTLE_S, RequestResult, first_model, scrape,
                                    send_request, serialized)
from benchmarks.bench.server_stages import device_busy, format_device_busy
from benchmarks.bench.workloads import (WARMUP_SEED, Ceilings, ModelShape, Trace, Workload,
                                        experts_read, fixed_workload, kv_waste,
                                        measure_ceilings, nano_workload, reset_experts_read,
                                        warmup_twin, with_output_len)
from common.config import (EngineConfig, ServerConfig, add_engine_args, add_server_args,
                           parse_configs)
from common.log import configure_logging
from common.messages import GenerateRequest
from common.sampling_params import RequestOutputKind, SamplingParams
from common.timing import PhaseClock
from services.offline.engine import Engine, fewer_collections, uses_worker_process
from services.worker import load_weights

SERVED_PATHS = ("pipeline", "http")  # through service processes
PATHS = ("inprocess", *SERVED_PATHS)
REQUEST_TIMEOUT_S = 600.0
# issue 31: LLM.generate at the served path's speed, on one shard
INPROCESS_OVER_HTTP_GOAL = 0.97


@dataclass(slots=True)
class RunResult:
    path: str
    workload: str
    requests: int
    output_tokens: int
    seconds: float
    phases: dict[str, float | int] | None = None  # where the run's time went
    data_parallel_size: int = 1
    device_busy_s: float | None = None  # the GPUs' time on its steps (None: not measured)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def label(self) -> str:
        return self.path + (f" dp={self.data_parallel_size}" if self.data_parallel_size > 1
                            else "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("nano", "8b", "fixed"), default="nano",
                        help="which workload to run (default nano)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests (default: 256 for nano, 64 otherwise)")
    parser.add_argument("--prompt-len", type=int, default=1000,
                        help="prompt tokens of the fixed and 8b workloads")
    parser.add_argument("--output-len", type=int, default=1000,
                        help="output tokens of the fixed and 8b workloads")
    parser.add_argument("--path", type=parse_paths, default=["inprocess"],
                        help="comma-separated serving paths to time, of inprocess, pipeline "
                             "and http (both: inprocess,pipeline); inprocess always runs, "
                             "first, since the floor and the other paths' ratios need it "
                             "(default inprocess)")
    parser.add_argument("--logprobs", type=int, default=None, metavar="N",
                        help="every request also asks for its sampled tokens' logprobs and "
                             "the top N (what the issue's logprobs=1 workload costs)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="every request samples with this top_p (the sampler's cost "
                             "beyond temperature alone)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="every request samples at this temperature (0: greedy; "
                             "default: the workload's, 0.6)")
    parser.add_argument("--n", type=int, default=None,
                        help="completions a request (the detokenizer-bound workload of "
                             "benchmarks/gpu/stage_scaling.sh asks for 4)")
    parser.add_argument("--step-thread", action=argparse.BooleanOptionalAction, default=True,
                        help="the in-process engine runs its executor on a step thread, "
                             "as LLM does (in a worker process on GPUs unless "
                             "HEADRACE_WORKER_PROCESS=0), or, with "
                             "--no-step-thread, in its loop")
    parser.add_argument("--compare", choices=("transformers",), default=None,
                        help="also run transformers' generate_batch on the same weights")
    parser.add_argument("--transformers-attn", default="paged|sdpa",
                        help="attn_implementation for the transformers run")
    parser.add_argument("--compare-num-prompts", type=int, default=64,
                        help="prompts of the workload both engines run for the comparison")
    parser.add_argument("--compare-output-len", type=int, default=512,
                        help="fixed output length of the comparison run")
    parser.add_argument("--compare-data-parallel", action="store_true",
                        help="with --data-parallel-size N > 1, also run each served path "
                             "with one shard and report N shards' throughput over one's")
    parser.add_argument("--json", default=None, help="write the results to this file")
    add_engine_args(parser)
    add_server_args(parser)  # the served paths' replicas (--detokenizer-replicas, ...)
    return parser


def parse_paths(text: str) -> list[str]:
    """`--path`: names of PATHS, comma-separated, in the order given; `both` is the older
    spelling of inprocess,pipeline."""
    paths: list[str] = []
    for name in (n.strip() for n in text.split(",")):
        if name not in (*PATHS, "both"):
            raise argparse.ArgumentTypeError(
                f"unknown path {name!r}: choose from {', '.join(PATHS)} (or both)")
        for path in ("inprocess", "pipeline") if name == "both" else (name,):
            if path not in paths:
                paths.append(path)
    return paths


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    if args.workload == "nano":
        workload = nano_workload(args.num_prompts or 256)
    else:
        workload = fixed_workload(args.workload, args.num_prompts or 64, args.prompt_len,
                                  args.output_len, vocab_size=vocab_size)
    return with_sampling(workload, logprobs=args.logprobs, top_p=args.top_p,
                         temperature=args.temperature, n=args.n)


def with_sampling(workload: Workload, **fields: float | int | None) -> Workload:
    """The workload with the sampling fields given (logprobs, top_p, temperature, n) set
    on every request, those given as None left alone; its name says so, since the figures
    differ."""
    changes = {name: value for name, value in fields.items() if value is not None}
    if not changes:
        return workload
    label = ",".join(f"{k}={v}" for k, v in changes.items())
    return dataclasses.replace(workload, name=f"{workload.name}[{label}]",
                               params=[p.replace(**changes) for p in workload.params])


def run_inprocess(engine: Engine, workload: Workload, trace: Trace | None = None,
                  shape: ModelShape | None = None) -> RunResult:
    """With a worker process the results are on the host when they come back (no sync),
    and the routed experts' counters are the child's: the trace counts none. Each
    completion's text comes at its end, as LLM.generate asks for it (FINAL_ONLY)."""
    runner = None if engine.executor is None else engine.runner
    if trace is not None and shape is not None:
        engine.on_plan = lambda plan: trace.record(plan, shape, kv_waste(engine.scheduler))
        if runner is not None:
            reset_experts_read(runner.model)
    run_id = uuid.uuid4().hex[:6]
    for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
        engine.add_request(f"{run_id}-{i}", prompt,
                           params.replace(output_kind=RequestOutputKind.FINAL_ONLY))
    output_tokens = 0
    if runner is not None:
        _sync(runner.device)
    engine.clock = PhaseClock()
    busy_before = engine.scheduler.device_seconds
    start = time.perf_counter()
    with fewer_collections():  # as LLM.generate runs its batch
        while engine.has_unfinished():
            output_tokens += sum(len(d.token_ids) for d in engine.step())
    if runner is not None:
        _sync(runner.device)
    engine.on_plan = None
    if trace is not None and shape is not None and runner is not None:
        trace.count_experts(shape, experts_read(runner.model))
    seconds = time.perf_counter() - start
    busy = engine.scheduler.device_seconds - busy_before
    return RunResult("inprocess", workload.name, len(workload.prompts), output_tokens,
                     seconds, engine.clock.summary(), device_busy_s=busy or None)


def run_served(path: str, config: EngineConfig, server: ServerConfig, workload: Workload
               ) -> RunResult:
    """The workload through local service processes: `pipeline` drives them from the bus,
    `http` through the gateway. A warm-up on the workload's warm-up twin comes first; every
    process has exited when this returns, so the next path finds the device free."""
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as root:
        pipeline = LocalPipeline(Path(root), config, server, gateway=path == "http")
        drive_workload, url = ((drive_bus, pipeline.url) if path == "pipeline" else
                               (drive_http, pipeline.http_url))
        try:
            anyio.run(pipeline.wait_ready)
            anyio.run(drive_workload, url, warmup_twin(workload, WARMUP_SEED))
            before = anyio.run(scrape_metrics, pipeline.http_url) if path == "http" else None
            tokens, seconds = anyio.run(drive_workload, url, workload)
            busy = None
            if before is not None:
                time.sleep(COUNTERS_SETTLE_S)
                busy = device_busy(before, anyio.run(scrape_metrics, pipeline.http_url))
        finally:
            pipeline.stop()
        phases = pipeline.loop_times()  # warm-up and timed run together
    return RunResult(path, workload.name, len(workload.prompts), tokens, seconds, phases,
                     config.data_parallel_size, busy or None)


async def scrape_metrics(http_url: str) -> str | None:
    """The gateway's Prometheus exposition, or None where it answers none."""
    async with aiohttp.ClientSession() as session:
        return await scrape(session, http_url + "/metrics")


async def drive_bus(redis_url: str, workload: Workload) -> tuple[int, float]:
    """(output tokens, seconds) of the workload published on the bus of `redis_url` as
    GenerateRequests; raises with the first error if any request fails."""
    run_id = uuid.uuid4().hex[:6]
    requests = [GenerateRequest(f"{run_id}-{i}", CLIENT, _overrides(params),
                                prompt_token_ids=prompt, arrival_time=time.time())
                for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params))]
    start = time.perf_counter()
    outcomes = await drive(redis_url, requests)
    seconds = time.perf_counter() - start
    failed = [rid for rid, o in outcomes.items() if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {outcomes[failed[0]].error}")
    tokens = sum(len(c.token_ids) for o in outcomes.values() for c in o.choices.values())
    return tokens, seconds


async def drive_http(http_url: str, workload: Workload) -> tuple[int, float]:
    """(output tokens by the usage numbers, seconds from the first send to the last
    completion) of the workload sent at once to the server at `http_url` as streamed
    /v1/completions requests, as users send them; raises with the first failure if any
    request fails."""
    root = http_url + "/v1"
    connector = aiohttp.TCPConnector(limit=0)  # no pool limit: every request opens at once
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = await first_model(session, root)
        bodies = [serialized(completion_body(model, prompt, params))
                  for prompt, params in zip(workload.prompts, workload.params)]
        origin = time.perf_counter()
        results = await asyncio.gather(*(
            send_request(session, root + "/completions", body,
                         RequestResult(i, len(prompt), params.max_tokens or 0), origin)
            for i, (prompt, params, body) in enumerate(zip(workload.prompts, workload.params,
                                                           bodies))))
    failures = [f for r in results if (f := http_failure(r)) is not None]
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(results)} HTTP requests failed, "
                           f"the first: {failures[0]}")
    seconds = max(r.start + r.e2e for r in results) - min(r.start for r in results)
    return sum(r.output_tokens for r in results), seconds


def completion_body(model: str, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "stream": True,
            "stream_options": {"include_usage": True}, **_overrides(params)}


def http_failure(result: RequestResult) -> str | None:
    """Why one HTTP request of the workload failed, or None: an error, or fewer tokens than
    asked (ignore_eos holds every length)."""
    if not result.success:
        return f"request {result.index}: {result.error}"
    if result.output_tokens < result.output_len:
        return (f"request {result.index}: {result.output_tokens} of {result.output_len} "
                "tokens")
    return None


def run_transformers(engine: Engine, workload: Workload, attn: str) -> RunResult:
    """transformers' continuous batching on the weights our engine holds."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    hf_config = engine.runner.hf_config
    hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn,
                                          dtype=engine.runner.dtype).to(engine.runner.device)
    copy_weights(engine.runner.model, hf)
    gen = GenerationConfig(max_new_tokens=workload.params[0].max_tokens, do_sample=True,
                           temperature=workload.params[0].temperature, eos_token_id=None,
                           pad_token_id=0)
    hf.generate_batch(workload.prompts[:2], generation_config=gen)  # warm-up
    _sync(engine.runner.device)
    start = time.perf_counter()
    outputs = hf.generate_batch(workload.prompts, generation_config=gen)
    _sync(engine.runner.device)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in outputs.values())
    del hf
    return RunResult(f"transformers[{attn}]", workload.name, len(workload.prompts), tokens,
                     seconds)


def copy_weights(ours: torch.nn.Module, hf: torch.nn.Module) -> None:
    """transformers' (random) weights into ours through our checkpoint loader, so both
    engines hold identical values."""
    load_weights(ours, hf.state_dict().items())


def _overrides(params: SamplingParams) -> dict[str, Any]:
    """The request fields of the workload's sampling, as a client sends them."""
    fields = {"temperature": params.temperature, "ignore_eos": True,
              "max_tokens": params.max_tokens, "top_p": params.top_p}
    if params.logprobs is not None:
        fields["logprobs"] = params.logprobs
    if params.n > 1:
        fields["n"] = params.n
    return fields


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def report(results: list[RunResult], floor_s: float, ceilings: Ceilings, waste: float,
           machine: dict[str, Any], experts_per_step: float = 0.0) -> str:
    lines = [f"machine: {machine['device']}; copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s, "
             f"bf16 matmul {ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s"]
    lines.append(f"{'path':<26}{'workload':<28}{'requests':>9}{'tokens':>10}{'seconds':>9}"
                 f"{'tok/s':>10}")
    for r in results:
        lines.append(f"{r.label:<26}{r.workload:<28}{r.requests:>9}{r.output_tokens:>10}"
                     f"{r.seconds:>9.2f}{r.tokens_per_s:>10.0f}")
        if r.phases:
            lines.append("    " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else
                                            f"{k} {v}" for k, v in r.phases.items()))
        if r.device_busy_s is not None:
            lines.append("    " + format_device_busy(r.device_busy_s, r.seconds))
    first = results[0]
    lines.append(f"floor of {first.workload}: {floor_s:.2f} s "
                 f"({first.output_tokens / floor_s:.0f} tok/s); achieved "
                 f"{floor_s / first.seconds:.1%} of it")
    lines.append(f"KV cache waste (allocated slots not holding a token), mean over steps: "
                 f"{waste:.2%}")
    if experts_per_step:
        lines.append(f"routed experts read per layer per step, mean: {experts_per_step:.1f} "
                     "(the floor counts their weights, not every expert's)")
    lines += ratio_lines(results)
    compared = [r for r in results if r.path.startswith("transformers")]
    ours = [r for r in results if r.path == "inprocess" and r.workload == compared[0].workload] \
        if compared else []
    if compared and ours:
        lines.append(f"headrace / transformers on {compared[0].workload}: "
                     f"{ours[0].tokens_per_s / compared[0].tokens_per_s:.1f}x")
    return "\n".join(lines)


def ratio_lines(results: list[RunResult]) -> list[str]:
    """Each served path's tokens/s over the in-process run's on the same workload (and the
    in-process run's over one shard's HTTP path, against its goal), and over the same
    path's with one shard where both ran."""
    inprocess = {r.workload: r for r in results if r.path == "inprocess"}
    one_shard = {(r.path, r.workload): r for r in results
                 if r.path in SERVED_PATHS and r.data_parallel_size == 1}
    lines = []
    for r in (r for r in results if r.path in SERVED_PATHS):
        if r.workload in inprocess:
            base = inprocess[r.workload]
            lines.append(f"{r.label} / inprocess: {r.tokens_per_s / base.tokens_per_s:.2f}x")
            if r.path == "http" and r.data_parallel_size == 1:  # the offline API's goal
                lines.append(f"inprocess / http: {base.tokens_per_s / r.tokens_per_s:.2f}x "
                             f"(goal: {INPROCESS_OVER_HTTP_GOAL:.2f}x or more)")
        one = one_shard.get((r.path, r.workload))
        if r.data_parallel_size > 1 and one is not None:
            lines.append(f"{r.label} / {one.label}: {r.tokens_per_s / one.tokens_per_s:.2f}x")
    return lines


def machine_info(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {"device": name or device.type, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}


@dataclass(slots=True)
class EngineRuns:
    """What the in-process engine measured, kept after the engine is gone."""
    workload: Workload
    results: list[RunResult]
    trace: Trace
    ceilings: Ceilings
    device: torch.device


def run_engine(args: argparse.Namespace, config: EngineConfig) -> EngineRuns:
    """The in-process path (and the transformers comparison). The engine lives only in
    this call, so its device memory can be released when it returns. Its executor runs
    where LLM's does (services/offline/engine.py's uses_worker_process), unless the
    comparison, which copies the model's weights, needs it here; the model's shape and the
    device's ceilings are then measured first, on an engine with the model in this
    process."""
    worker_process = args.compare is None and uses_worker_process(config, args.step_thread)
    if worker_process:
        shape, ceilings, device = measure_model(config)
    engine = Engine(config, step_thread=args.step_thread, worker_process=worker_process)
    if not worker_process:
        shape, ceilings, device = model_facts(engine)
    workload = make_workload(args, engine.info.vocab_size)
    # the kernels of every step shape compile untimed, on prompts the timed run won't reuse
    run_inprocess(engine, warmup_twin(workload, WARMUP_SEED))
    trace = Trace()
    results = [run_inprocess(engine, workload, trace, shape)]
    if args.compare == "transformers":
        subset = with_output_len(workload, args.compare_num_prompts, args.compare_output_len)
        results.append(run_transformers(engine, subset, args.transformers_attn))
        results.append(run_inprocess(engine, subset))
    engine.close()  # the served paths' worker takes the GPUs and the ranks' group
    return EngineRuns(workload, results, trace, ceilings, device)


def model_facts(engine: Engine) -> tuple[ModelShape, Ceilings, torch.device]:
    """The shape of the model in the engine's process, and its device's ceilings."""
    runner = engine.runner
    shape = ModelShape.of(runner.model, runner.hf_config, engine.config.tensor_parallel_size,
                          runner.kv_caches[0][0].element_size())
    return shape, measure_ceilings(runner.device), runner.device


def measure_model(config: EngineConfig) -> tuple[ModelShape, Ceilings, torch.device]:
    """model_facts of an engine built for them alone (eager: no graphs to capture), its
    device memory released before the timed engine's worker process loads the model."""
    engine = Engine(dataclasses.replace(config, enforce_eager=True),
                    detokenizer_process=False, step_thread=False)
    facts = model_facts(engine)
    engine.close()
    del engine
    release_device(facts[2])
    return facts


def release_device(device: torch.device) -> None:
    """Free what the engine held (its reference cycles too) and hand the cached device
    memory back, so that a served path's worker process can allocate it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    parser = build_parser()
    args, config, server = parse_configs(parser, argv)
    if args.compare and config.tensor_parallel_size > 1:
        parser.error("--compare transformers copies one rank's weights: use "
                     "--tensor-parallel-size 1")
    if args.compare_data_parallel and config.data_parallel_size == 1:
        parser.error("--compare-data-parallel compares --data-parallel-size N > 1 with one")
    configure_logging("bench")
    runs = run_engine(args, dataclasses.replace(config, data_parallel_size=1))
    release_device(runs.device)
    sizes = [1, config.data_parallel_size] if args.compare_data_parallel else \
        [config.data_parallel_size]
    results = runs.results + [
        run_served(path, dataclasses.replace(config, data_parallel_size=size), server,
                   runs.workload)
        for path in args.path if path != "inprocess" for size in sizes]
    ceilings, trace = runs.ceilings, runs.trace
    floor_s = trace.floor_seconds(ceilings.copy_bytes_per_s, ceilings.matmul_flops_per_s)
    machine = machine_info(runs.device)
    print(report(results, floor_s, ceilings, trace.mean_waste, machine,
                 trace.experts_per_layer_step))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "headrace bench throughput " + " ".join(argv), "machine": machine,
            "ceilings": asdict(ceilings), "floor_seconds": floor_s,
            "kv_waste_mean": trace.mean_waste,
            "experts_per_layer_step": trace.experts_per_layer_step,
            "results": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results]},
            indent=2))
    return 0

"""`headrace bench serve`: online serving latency and throughput of any OpenAI-compatible
server, measured from the client.

    headrace bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --request-rate 4 --dataset random --random-input-len 512 --random-output-len 128 \\
        --save-result serve.json --plot serve.png

Requests arrive as a Poisson process (--request-rate; inf sends them all at once), at most
--max-concurrency open at a time. Every request streams (server-sent events read through
aiohttp, so each chunk gets its own timestamp) and asks for usage in the stream
(stream_options.include_usage), and ignore_eos with max_tokens makes output lengths the
planned ones. Per request: TTFT (send to the first chunk carrying output), ITL (the gaps
between later output chunks), TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e latency;
token counts are the server's usage numbers. A request succeeds by its tokens, not its
text: the ids of a model with dummy weights often decode to nothing. With --n, each request
asks for n completions, whose chunks share its stream (TPOT is then one completion's).
Where the server's GET /metrics has headrace's `headrace:stage_seconds` histogram, the
run's share of it (the difference of scrapes before and after) is printed beside the
client's view, and so is each shard's prefix-cache hit rate over the run.

The prefix_repetition dataset (vLLM's) sends --num-prompts requests that share
--prefix-repetition-num-prefixes prefixes (system prompts) evenly, each prefix followed by
its own random suffix (the user turn), in random order: what prefix caching and
data-parallel prefix routing are for. The random-mm dataset (vLLM's, chat only) adds images
of random pixels to each request as base64 `image_url` parts (benchmarks/bench/random_mm.py).
Every request body, images included, is built and serialized before the timed run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import uvloop
from tqdm import tqdm

from benchmarks.bench.random_mm import (DEFAULT_BUCKET_CONFIG, DEFAULT_LIMIT_MM_PER_PROMPT,
                                        DatasetError, MultimodalSpec, image_sizes, image_urls)
from benchmarks.bench.server_stages import (PrefixCache, StageStats, device_busy,
                                            format_device_busy, format_prefix_cache,
                                            format_stages, prefix_cache_use, stage_breakdown)

# Common English words, each one token (with its leading space) in the Llama 3, Qwen2/3
# and SmolLM2 vocabularies, so a prompt of N words is about N tokens in them; the
# measured prompt lengths are the server's usage numbers either way.
WORDS = (
    "the of and to in is was for on that with as by at from his her it an are be this "
    "which or had not but were have one their they all been can more has its also two "
    "after first new would who will other into when time there some these only over "
    "where about most him then may three up out made year world state than like years "
    "later under part used city during many such between both known being through before "
    "since while people well each day water work life end back long house high group "
    "school power order game side name line form place way point head view fact case "
    "week month night home room land river music film book team war king church body "
    "family light free open field party round court word hand market story money area"
).split()
# The synthetic ShareGPT-like lengths: log-normal, with the means of the ShareGPT V3
# conversations that serving benchmarks sample (about 161 prompt and 338 output tokens),
# kept to what those benchmarks keep (4 to 1024 prompt tokens, at most 2048 in all).
SHAREGPT_INPUT_MEAN, SHAREGPT_OUTPUT_MEAN, SHAREGPT_SIGMA = 161.0, 338.0, 1.0
SHAREGPT_MIN_LEN, SHAREGPT_MAX_INPUT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
PERCENTILES = (50, 90, 99)
METRICS_TIMEOUT_S = 10.0
JSON_HEADERS = {"Content-Type": "application/json"}
COUNTERS_SETTLE_S = 1.0  # two of the schedulers' stats periods: the run's last counts arrive


# --- the workload ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PlannedRequest:
    prompt: str | list[int]
    prompt_len: int  # words, or token ids for token-id prompts
    output_len: int
    send_at: float  # seconds after the benchmark starts
    images: tuple[str, ...] = ()  # data URLs, sent after the text (random-mm)


def random_lengths(rng: random.Random, n: int, input_len: int, output_len: int,
                   range_ratio: float) -> list[tuple[int, int]]:
    """Lengths uniform in [len * (1 - ratio), len * (1 + ratio)], at least 1."""
    def draw(length: int) -> int:
        low = max(1, round(length * (1 - range_ratio)))
        return rng.randint(low, max(low, round(length * (1 + range_ratio))))
    return [(draw(input_len), draw(output_len)) for _ in range(n)]


def sharegpt_lengths(rng: random.Random, n: int, input_mean: float, output_mean: float,
                     sigma: float) -> list[tuple[int, int]]:
    """Log-normal prompt and output lengths with the given means, clipped to ShareGPT's
    usual filter (4..1024 prompt tokens, 4.. output tokens, 2048 in all)."""
    def draw(mean: float) -> int:
        return round(rng.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma))
    lengths = []
    for _ in range(n):
        prompt = min(max(draw(input_mean), SHAREGPT_MIN_LEN), SHAREGPT_MAX_INPUT)
        output = min(max(draw(output_mean), SHAREGPT_MIN_LEN), SHAREGPT_MAX_TOTAL - prompt)
        lengths.append((prompt, output))
    return lengths


def arrival_offsets(rng: random.Random, n: int, rate: float) -> list[float]:
    """Send times of a Poisson process of `rate` requests/s (exponential gaps), the first
    at 0; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    offsets, now = [], 0.0
    for _ in range(n):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def make_prompt(rng: random.Random, length: int, token_id_limit: int | None) -> str | list[int]:
    if token_id_limit is not None:
        return [rng.randrange(token_id_limit) for _ in range(length)]
    return " ".join(rng.choice(WORDS) for _ in range(length))


def plan_requests(args: argparse.Namespace) -> list[PlannedRequest]:
    rng = random.Random(args.seed)
    if args.dataset == "prefix_repetition":
        return plan_prefix_repetition(args, rng)
    if args.dataset == "random-mm":
        return plan_random_mm(args, rng)
    if args.dataset == "random":
        lengths = random_lengths(rng, args.num_prompts, args.random_input_len,
                                 args.random_output_len, args.random_range_ratio)
    else:
        lengths = sharegpt_lengths(rng, args.num_prompts, args.sharegpt_input_mean,
                                   args.sharegpt_output_mean, args.sharegpt_sigma)
    offsets = arrival_offsets(rng, args.num_prompts, args.request_rate)
    return [PlannedRequest(make_prompt(rng, p, args.token_id_prompts), p, o, t)
            for (p, o), t in zip(lengths, offsets)]


def plan_prefix_repetition(args: argparse.Namespace, rng: random.Random
                           ) -> list[PlannedRequest]:
    """--num-prompts requests over the prefixes in turn, each prefix plus a suffix of its
    own, shuffled."""
    limit = args.token_id_prompts
    prefixes = [make_prompt(rng, args.prefix_repetition_prefix_len, limit)
                for _ in range(args.prefix_repetition_num_prefixes)]
    prompts = []
    for i in range(args.num_prompts):
        prefix = prefixes[i % len(prefixes)]
        suffix = make_prompt(rng, args.prefix_repetition_suffix_len, limit)
        prompts.append(prefix + suffix if limit is not None else f"{prefix} {suffix}")
    rng.shuffle(prompts)
    length = args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len
    offsets = arrival_offsets(rng, args.num_prompts, args.request_rate)
    return [PlannedRequest(prompt, length, args.prefix_repetition_output_len, t)
            for prompt, t in zip(prompts, offsets)]


def random_mm_spec(args: argparse.Namespace) -> MultimodalSpec:
    return MultimodalSpec.of(args.random_mm_base_items_per_request,
                             args.random_mm_num_mm_items_range_ratio,
                             args.random_mm_limit_mm_per_prompt, args.random_mm_bucket_config)


def plan_random_mm(args: argparse.Namespace, rng: random.Random) -> list[PlannedRequest]:
    """The random dataset's prompts, each with its images (random_mm.py)."""
    lengths = random_lengths(rng, args.num_prompts, args.random_input_len,
                             args.random_output_len, args.random_range_ratio)
    offsets = arrival_offsets(rng, args.num_prompts, args.request_rate)
    prompts = [make_prompt(rng, p, None) for p, _ in lengths]
    images = image_urls(image_sizes(random_mm_spec(args), rng, args.num_prompts), args.seed)
    return [PlannedRequest(prompt, p, o, t, urls)
            for prompt, (p, o), t, urls in zip(prompts, lengths, offsets, images)]


def chat_content(planned: PlannedRequest) -> str | list[dict[str, Any]]:
    """The user turn: the prompt, or with images a text part followed by image_url parts
    (as vLLM's benchmark sends them)."""
    if not planned.images:
        return planned.prompt
    return [{"type": "text", "text": planned.prompt},
            *({"type": "image_url", "image_url": {"url": url}} for url in planned.images)]


def request_body(args: argparse.Namespace, model: str, planned: PlannedRequest
                 ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.n != 1:
        body["n"] = args.n
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": chat_content(planned)}]
        body["max_completion_tokens"] = planned.output_len
        if args.logprobs is not None:
            body.update(logprobs=True, top_logprobs=args.logprobs)
    else:
        body["prompt"] = planned.prompt
        body["max_tokens"] = planned.output_len
        if args.logprobs is not None:
            body["logprobs"] = args.logprobs
    return body


# --- one streamed response -----------------------------------------------------------------

class SseDecoder:
    """Bytes of a text/event-stream in, the payloads of its `data:` lines out."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        payloads = []
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip().decode())
        return payloads


@dataclass(slots=True)
class RequestResult:
    index: int
    prompt_len: int  # planned
    output_len: int  # planned, of each completion
    n: int = 1  # completions the request asks for
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds after the benchmark started
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between output chunks
    chunks: int = 0  # chunks that carried output
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        """One completion's: a request's n completions stream side by side, and the usage
        counts the tokens of all of them."""
        per_completion = self.output_tokens / self.n
        if per_completion < 2:
            return None
        return (self.e2e - self.ttft) / (per_completion - 1)


class StreamTimer:
    """Turns a stream's chunks and their arrival times into one RequestResult."""

    def __init__(self, result: RequestResult, sent: float) -> None:
        self.result = result
        self.sent = sent
        self.last_output = 0.0

    def observe(self, payload: str, now: float) -> bool:
        """Take one `data:` payload; False once the stream is over ([DONE] or an error)."""
        if payload == "[DONE]":
            return False
        chunk = json.loads(payload)
        if "error" in chunk:
            self.result.error = str(chunk["error"].get("message", chunk["error"]))
            return False
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.result.output_tokens = usage["completion_tokens"]
            self.result.prompt_tokens = usage.get("prompt_tokens") or 0
            self.result.usage_reported = True
        if any(carries_output(c) for c in chunk.get("choices") or ()):
            self._output_at(now)
        return True

    def _output_at(self, now: float) -> None:
        if self.result.chunks == 0:
            self.result.ttft = now - self.sent
        else:
            self.result.itl.append(now - self.last_output)
        self.last_output = now
        self.result.chunks += 1

    def finish(self, now: float) -> RequestResult:
        result = self.result
        result.e2e = now - self.sent
        if not result.usage_reported:  # a server that ignores include_usage
            result.output_tokens = result.chunks
            result.prompt_tokens = result.prompt_len
        if not result.error and (result.chunks == 0 or result.output_tokens == 0):
            result.error = "the stream ended without output"
        result.success = not result.error
        return result


def carries_output(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice stands for generated tokens, whatever its text: servers
    send one for tokens whose text is empty too (a dummy model's ids often decode to
    nothing, and headrace's last chunk may hold no text). A completions choice always does;
    a chat delta does unless it only announces the role or is empty (a bare finish)."""
    delta = choice.get("delta")
    if delta is None or choice.get("logprobs") or choice.get("token_ids"):
        return True
    if delta.get("role") is not None:
        return bool(delta.get("content"))
    return bool(delta)


# --- aggregates ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Stats:
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls(0.0, 0.0, 0.0, 0.0, 0)
        ms = np.asarray(seconds) * 1000.0
        p50, p90, p99 = np.percentile(ms, PERCENTILES)
        return cls(float(ms.mean()), float(p50), float(p90), float(p99), len(ms))


@dataclass(frozen=True, slots=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    tokens_per_chunk: float  # above 1: the server batches tokens into chunks, ITL is per chunk
    max_concurrency_seen: int
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats


def max_overlap(results: list[RequestResult]) -> int:
    """The most requests that were open at one moment."""
    edges = sorted([(r.start, 1) for r in results] + [(r.start + r.e2e, -1) for r in results],
                   key=lambda e: (e[0], e[1]))
    open_now = most = 0
    for _, step in edges:
        open_now += step
        most = max(most, open_now)
    return most


def summarize(results: list[RequestResult], duration_s: float) -> Summary:
    ok = [r for r in results if r.success]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    return Summary(
        completed=len(ok), failed=len(results) - len(ok), duration_s=duration_s,
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(ok) / duration_s, output_throughput=outputs / duration_s,
        total_token_throughput=(inputs + outputs) / duration_s,
        tokens_per_chunk=outputs / chunks if chunks else 0.0,
        max_concurrency_seen=max_overlap(results),
        ttft=Stats.of([r.ttft for r in ok]),
        tpot=Stats.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stats.of([gap for r in ok for gap in r.itl]),
        e2e=Stats.of([r.e2e for r in ok]))


def format_summary(summary: Summary) -> str:
    width = 50
    lines = [" Serving Benchmark Result ".center(width, "="),
             f"{'Successful requests:':<40}{summary.completed:>10}",
             f"{'Failed requests:':<40}{summary.failed:>10}",
             f"{'Benchmark duration (s):':<40}{summary.duration_s:>10.2f}",
             f"{'Total input tokens:':<40}{summary.total_input_tokens:>10}",
             f"{'Total generated tokens:':<40}{summary.total_output_tokens:>10}",
             f"{'Request throughput (req/s):':<40}{summary.request_throughput:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{summary.output_throughput:>10.2f}",
             f"{'Total token throughput (tok/s):':<40}{summary.total_token_throughput:>10.2f}",
             f"{'Tokens per streamed chunk:':<40}{summary.tokens_per_chunk:>10.2f}",
             f"{'Most requests open at once:':<40}{summary.max_concurrency_seen:>10}"]
    for title, short, stats in (("Time to First Token", "TTFT", summary.ttft),
                                ("Time per Output Token (excl. 1st token)", "TPOT",
                                 summary.tpot),
                                ("Inter-token Latency", "ITL", summary.itl),
                                ("End-to-end Latency", "E2E", summary.e2e)):
        lines.append(f" {title} ".center(width, "-"))
        for label, value in (("Mean", stats.mean_ms), ("Median", stats.median_ms),
                             ("P90", stats.p90_ms), ("P99", stats.p99_ms)):
            lines.append(f"{f'{label} {short} (ms):':<40}{value:>10.2f}")
    lines.append("=" * width)
    return "\n".join(lines)


# --- the client --------------------------------------------------------------------------------

def api_root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def serialized(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


async def send_request(session: aiohttp.ClientSession, url: str, body: bytes,
                       result: RequestResult, origin: float) -> RequestResult:
    """body: the JSON request, serialized before the run (a body with images is a
    megabyte, whose serializing would otherwise delay every request sent after it)."""
    sent = time.perf_counter()
    result.start = sent - origin
    timer = StreamTimer(result, sent)
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return timer.finish(time.perf_counter())
            decoder = SseDecoder()
            async for data in response.content.iter_any():
                now = time.perf_counter()
                if not all(timer.observe(p, now) for p in decoder.feed(data)):
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return timer.finish(time.perf_counter())


class NoModel(Exception):
    """The server could not say which model it serves."""


async def first_model(session: aiohttp.ClientSession, root: str) -> str:
    try:
        async with session.get(root + "/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError) as e:
        raise NoModel(f"cannot learn the model from GET {root}/models ({e}); "
                      "give --model") from e


def metrics_url(base_url: str) -> str:
    """Prometheus' /metrics sits at the server's root, beside /v1."""
    return api_root(base_url).removesuffix("/v1") + "/metrics"


async def scrape(session: aiohttp.ClientSession, url: str) -> str | None:
    """The server's Prometheus exposition, or None where it has none."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=METRICS_TIMEOUT_S)
                               ) as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
        return None


@dataclass(slots=True)
class BenchmarkRun:
    model: str
    results: list[RequestResult]
    duration_s: float
    stages: list[StageStats]  # the server's breakdown (empty: it keeps none)
    prefix_cache: list[PrefixCache]  # per shard (empty: the server keeps no such counters)
    client_cores: float  # this process's CPU seconds over the run's: near 1, it is the bound
    started_at: float  # the run's start, Unix seconds: to line it up with other records
    device_busy_s: float | None = None  # the server's GPU time on steps (None: not kept)


async def run_benchmark(args: argparse.Namespace, planned: list[PlannedRequest]
                        ) -> BenchmarkRun:
    root = api_root(args.base_url)
    url = root + ("/chat/completions" if args.endpoint == "chat" else "/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    limit = args.max_concurrency or 0  # 0: aiohttp's pool is unbounded
    connector = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as session:
        model = args.model or await first_model(session, root)
        bodies = [serialized(request_body(args, model, plan)) for plan in planned]
        before = await scrape(session, metrics_url(args.base_url))
        gate = asyncio.Semaphore(args.max_concurrency or len(planned) or 1)
        bar = tqdm(total=len(planned), desc="requests", disable=args.disable_tqdm)
        origin, cpu_origin, started_at = time.perf_counter(), time.process_time(), time.time()

        async def one(index: int, plan: PlannedRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, origin + plan.send_at - time.perf_counter()))
            async with gate:
                result = await send_request(session, url, bodies[index],
                                            RequestResult(index, plan.prompt_len,
                                                          plan.output_len, args.n), origin)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(planned)))
        duration = time.perf_counter() - origin
        client_cores = (time.process_time() - cpu_origin) / duration
        bar.close()
        if before is not None:  # the schedulers' counters come every half second
            await asyncio.sleep(COUNTERS_SETTLE_S)
        after = await scrape(session, metrics_url(args.base_url))
    stages = stage_breakdown(before, after) if after is not None else []
    cache = prefix_cache_use(before, after) if after is not None else []
    return BenchmarkRun(model, list(results), duration, stages, cache, client_cores,
                        started_at, device_busy(before, after))


# --- output ------------------------------------------------------------------------------------

def plot_latencies(results: list[RequestResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    series = [("TTFT", [r.ttft for r in ok]),
              ("ITL", [gap for r in ok for gap in r.itl]),
              ("TPOT", [t for r in ok if (t := r.tpot) is not None]),
              ("end-to-end latency", [r.e2e for r in ok])]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, seconds) in zip(axes.flat, series):
        ms = np.asarray(seconds) * 1000.0
        ax.set_title(f"{name} ({len(ms)} samples)", fontsize=10)
        ax.set_xlabel("ms")
        if len(ms):
            ax.hist(ms, bins=min(50, max(5, len(ms) // 4)), color="tab:blue", alpha=0.8)
            for q, style in zip(PERCENTILES, (":", "--", "-")):
                ax.axvline(np.percentile(ms, q), color="tab:red", linestyle=style,
                           label=f"p{q} {np.percentile(ms, q):.1f}")
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}  # no secrets in files
    settings["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) \
        else args.request_rate
    return settings


def redacted(argv: list[str]) -> list[str]:
    """The command line without the API key's value."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--api-key="):
            arg = "--api-key=***"
        elif i > 0 and argv[i - 1] == "--api-key":
            arg = "***"
        out.append(arg)
    return out


def save_result(path: Path, args: argparse.Namespace, run: BenchmarkRun, summary: Summary,
                argv: list[str]) -> None:
    requests = [asdict(r) | {"tpot": r.tpot} for r in run.results]
    path.write_text(json.dumps({
        "command": "headrace bench serve " + " ".join(redacted(argv)),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": run.model, "settings": settings_of(args), "summary": asdict(summary),
        "client_cores": round(run.client_cores, 3), "started_at": run.started_at,
        "server_stages": [asdict(s) for s in run.stages],
        "prefix_cache": [asdict(c) | {"hit_rate": c.hit_rate} for c in run.prefix_cache],
        "device_busy_s": run.device_busy_s, "requests": requests}, indent=1, default=str) + "\n")


# --- the command -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the first one GET /v1/models lists)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default completions)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second of Poisson arrivals; inf (the default) "
                        "sends every request at once")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests open at once; later arrivals wait for a slot "
                        "(default: no limit)")
    p.add_argument("--dataset", choices=("random", "synthetic-sharegpt", "prefix_repetition",
                                         "random-mm"),
                   default="random",
                   help="random: lengths uniform around --random-input-len/--random-output-"
                        "len; synthetic-sharegpt: log-normal lengths shaped like the "
                        "ShareGPT conversations (the real dataset cannot be downloaded "
                        "here: there is no internet access); prefix_repetition: prompts "
                        "sharing a few prefixes (--prefix-repetition-*); random-mm (chat "
                        "only): the random dataset's prompts, each followed by images of "
                        "random pixels (--random-mm-*). Prompts are random common words, "
                        "each one token in Llama/Qwen/SmolLM2 vocabularies")
    p.add_argument("--random-input-len", type=int, default=1024,
                   help="random dataset: mean prompt length in tokens (default 1024)")
    p.add_argument("--random-output-len", type=int, default=128,
                   help="random dataset: mean output length in tokens (default 128)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random dataset: lengths uniform in [len * (1 - r), len * (1 + r)], "
                        "0 <= r < 1 (default 0: every length exactly the given one)")
    p.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                   help="random-mm: images per request (default 1)")
    p.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="random-mm: images per request uniform in [n * (1 - r), n * (1 + r)], "
                        "0 <= r <= 1 (default 0: exactly n)")
    p.add_argument("--random-mm-limit-mm-per-prompt", default=DEFAULT_LIMIT_MM_PER_PROMPT,
                   help="random-mm: most items per request, as JSON, e.g. '{\"image\": 1}' "
                        f"(default '{DEFAULT_LIMIT_MM_PER_PROMPT}'; the server's own "
                        "--limit-mm-per-prompt must allow as many)")
    p.add_argument("--random-mm-bucket-config", default=DEFAULT_BUCKET_CONFIG,
                   help="random-mm: image sizes, as vLLM's dict of (height, width, frames) -> "
                        "probability, e.g. '{(1024, 1024, 1): 1.0}'; frames must be 1 "
                        f"(images; videos are refused) (default '{DEFAULT_BUCKET_CONFIG}')")
    p.add_argument("--sharegpt-input-mean", type=float, default=SHAREGPT_INPUT_MEAN,
                   help="synthetic-sharegpt: mean prompt tokens (default "
                        f"{SHAREGPT_INPUT_MEAN:g}, ShareGPT V3's)")
    p.add_argument("--sharegpt-output-mean", type=float, default=SHAREGPT_OUTPUT_MEAN,
                   help="synthetic-sharegpt: mean output tokens (default "
                        f"{SHAREGPT_OUTPUT_MEAN:g}, ShareGPT V3's)")
    p.add_argument("--sharegpt-sigma", type=float, default=SHAREGPT_SIGMA,
                   help="synthetic-sharegpt: sigma of the log-normal lengths, their spread "
                        f"(default {SHAREGPT_SIGMA:g}); lengths are then kept to prompts of "
                        f"{SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_INPUT} tokens and outputs of at "
                        f"least {SHAREGPT_MIN_LEN}, {SHAREGPT_MAX_TOTAL} tokens in all")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each shared prefix (default 256)")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix_repetition: tokens of each request's own suffix (default 256)")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix_repetition: how many prefixes the requests share evenly "
                        "(default 10)")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="prefix_repetition: output tokens of each request (default 128)")
    p.add_argument("--token-id-prompts", type=int, metavar="VOCAB", default=None,
                   help="completions only: send prompts as random token ids below VOCAB "
                        "instead of words, so prompt lengths are exact (the server must "
                        "take token-id prompts, as headrace and vLLM do)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="top_p of every request")
    p.add_argument("--n", type=int, default=1,
                   help="completions each request asks for (the request's n, as vLLM's "
                        "bench throughput --n); their chunks share one stream, so ITL is "
                        "between any of them, and TPOT is one completion's")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="every request asks for its tokens' logprobs and the top N "
                        "(chat: logprobs true, top_logprobs N)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to ignore EOS so every output has its planned length "
                        "(a vLLM extension; --no-ignore-eos for servers that refuse it)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, prompts and arrivals")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take before it counts as failed")
    p.add_argument("--save-result", type=Path, default=None, metavar="FILE",
                   help="write the settings, every request's metrics and the aggregates "
                        "to this JSON file")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="write histograms of TTFT, ITL, TPOT and e2e latency to this PNG")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_prompts", "n", "random_input_len", "random_output_len",
                 "prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
                 "prefix_repetition_num_prefixes", "prefix_repetition_output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be positive (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not 0 <= args.random_range_ratio < 1:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.token_id_prompts is not None and args.endpoint == "chat":
        parser.error("--token-id-prompts needs --endpoint completions (chat takes text)")
    if min(args.sharegpt_input_mean, args.sharegpt_output_mean, args.sharegpt_sigma) <= 0:
        parser.error("the --sharegpt-* settings must be positive")
    if args.dataset == "random-mm":
        if args.endpoint != "chat":
            parser.error("--dataset random-mm needs --endpoint chat (images travel as "
                         "image_url parts of a chat message)")
        try:
            random_mm_spec(args)
        except DatasetError as e:
            parser.error(str(e))


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    planned = plan_requests(args)
    try:
        # uvloop: a thousand streams' chunks are parsed in this one loop, and a slow
        # client would pass its own queueing off as the server's latency
        run = uvloop.run(run_benchmark(args, planned))
    except NoModel as e:
        print(f"headrace bench serve: {e}", file=sys.stderr)
        return 1
    summary = summarize(run.results, run.duration_s)
    print(format_summary(summary))
    print(f"{'Client CPU (cores, 1 = saturated):':<40}{run.client_cores:>10.2f}")
    if run.stages:
        print(format_stages(run.stages))
    if run.prefix_cache:
        print(format_prefix_cache(run.prefix_cache))
    if run.device_busy_s is not None:
        print(format_device_busy(run.device_busy_s, run.duration_s))
    for failure in [r for r in run.results if not r.success][:5]:
        print(f"request {failure.index} failed: {failure.error}", file=sys.stderr)
    if args.save_result:
        save_result(args.save_result, args, run, summary, argv)
    if args.plot:
        plot_latencies(run.results, args.plot,
                       f"{run.model}, {args.endpoint}, {args.num_prompts} requests at "
                       f"{args.request_rate:g}/s, concurrency {args.max_concurrency or 'any'}")
    return 0 if summary.completed else 1

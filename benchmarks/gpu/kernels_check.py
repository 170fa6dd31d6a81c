"""The device script for the Triton kernels: checks them against their torch references at
real shapes (the CUDA tests of tests/test_kernels_triton.py), measures the machine's two
ceilings (copy bandwidth, bf16 matmul rate), times every kernel (triton.testing.do_bench,
median, L2 flushed between runs) with its floor, sweeps the attention launch configs, and
prints a short table last. Full results go to <out>/kernels.json.

    source .devkit/env.sh && python benchmarks/gpu/kernels_check.py --out $OUT

--window-only times only the sliding-window and soft-cap cases (window_suite): a decode
at 32 x 8000 keys with a window of 1024 should cost about 1024 / 8000 of the full one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from kernels.attention import paged_attention_torch  # noqa: E402
from kernels.cache import write_kv_ref, write_kv_triton  # noqa: E402
from kernels.norm import rms_norm_ref, rms_norm_triton  # noqa: E402
from kernels.rotary import apply_rotary_ref, apply_rotary_triton, rope_cos_sin_cache  # noqa: E402
from kernels.triton_attention import (AttentionConfig,  # noqa: E402
                                      _paged_attention_kernel, default_config,
                                      paged_attention_triton, sm_count)

# (heads, KV heads, head_dim, hidden, intermediate)
QWEN3_06B = (16, 8, 128, 1024, 3072)
LLAMA_8B = (32, 8, 128, 4096, 14336)
GEMMA2_9B = (16, 8, 256, 3584, 14336)
BF16 = torch.bfloat16


@dataclass
class Result:
    name: str
    us: float
    floor_us: float
    note: str = ""

    @property
    def fraction(self) -> float:
        return self.floor_us / self.us if self.us else 0.0


@dataclass
class Ceilings:
    bandwidth: float  # bytes / s, read + written
    matmul: float     # bf16 FLOP / s


def bench_us(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3


def run_tests(out_dir: Path) -> str:
    start = time.time()
    # 4 workers: the tests spend most of their time compiling kernel variants
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "4", "--maxfail=20",
                           "--timeout=600", "tests/test_kernels_triton.py", "-k", "cuda"],
                          cwd=REPO, capture_output=True, text=True)
    (out_dir / "tests.log").write_text(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
    return f"rc={proc.returncode} {summary} ({time.time() - start:.0f} s)"


def measure_ceilings() -> Ceilings:
    src = torch.randn(2 ** 29, device="cuda", dtype=BF16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_s = bench_us(lambda: dst.copy_(src)) / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    b = torch.randn(8192, 8192, device="cuda", dtype=BF16)
    matmul_s = bench_us(lambda: a @ b) / 1e6
    return Ceilings(2 * src.numel() * 2 / copy_s, 2 * 8192 ** 3 / matmul_s)


# --- attention ----------------------------------------------------------------------------

def attention_batch(model: tuple, requests: list[tuple[int, int]], block_size: int = 16,
                    seed: int = 0) -> dict:
    """Random K/V for every request's context on shuffled blocks, random queries."""
    heads, kv_heads, head_dim = model[:3]
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(ctx / block_size) for ctx, _ in requests]
    num_blocks = sum(blocks) + 8
    pool = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
    taken = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = pool[taken:taken + n]
        taken += n
    q_lens = torch.tensor([q for _, q in requests])
    cache = (num_blocks, block_size, kv_heads, head_dim)
    return dict(q=torch.randn(int(q_lens.sum()), heads, head_dim, device="cuda", dtype=BF16),
                k_cache=torch.randn(cache, device="cuda", dtype=BF16),
                v_cache=torch.randn(cache, device="cuda", dtype=BF16),
                block_tables=tables.cuda(),
                query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).int().cuda(),
                seq_lens=torch.tensor([c for c, _ in requests], dtype=torch.int32).cuda(),
                scale=head_dim ** -0.5)


def attention_floor_us(model: tuple, requests: list[tuple[int, int]], ceilings: Ceilings,
                       sliding_window: int | None = None) -> tuple[float, str]:
    """Bytes: each context's K and V once (with a window, only the keys some query of the
    request sees), q in, out back; FLOPs: 4 * head_dim per (query head, visible key). The
    larger time is the floor."""
    heads, kv_heads, head_dim = model[:3]
    window = sliding_window or max(ctx for ctx, _ in requests)
    read = sum(min(ctx, window + q - 1) for ctx, q in requests)
    kv_bytes = read * kv_heads * head_dim * 2 * 2
    q_bytes = sum(q for _, q in requests) * heads * head_dim * 2 * 2
    visible = sum(min(pos + 1, window) for ctx, q in requests for pos in range(ctx - q, ctx))
    bytes_us = (kv_bytes + q_bytes) / ceilings.bandwidth * 1e6
    flops_us = visible * heads * 4 * head_dim / ceilings.matmul * 1e6
    return max(bytes_us, flops_us), "bytes" if bytes_us >= flops_us else "flops"


def time_attention(name: str, model: tuple, requests: list[tuple[int, int]],
                   ceilings: Ceilings, max_seq_len: int | None = None,
                   config: AttentionConfig | None = None, sliding_window: int | None = None,
                   soft_cap: float | None = None) -> Result:
    batch = attention_batch(model, requests)
    max_query_len = max(q for _, q in requests)
    max_seq_len = max_seq_len or max(c for c, _ in requests)
    us = bench_us(lambda: paged_attention_triton(**batch, max_query_len=max_query_len,
                                                 max_seq_len=max_seq_len, config=config,
                                                 sliding_window=sliding_window,
                                                 soft_cap=soft_cap))
    floor, bound = attention_floor_us(model, requests, ceilings, sliding_window)
    used = config or default_config(batch["q"])
    return Result(name, us, floor, f"{bound}-bound; {config_label(used)}")


def config_label(c: AttentionConfig) -> str:
    d, p = c.decode, c.prefill
    return (f"dec m{d.block_m} n{d.block_n} w{d.num_warps} s{d.num_stages} | "
            f"pre m{p.block_m} n{p.block_n} w{p.num_warps} s{p.num_stages} | "
            f"t{c.target_programs} p{c.min_partition}")


def sweep(name: str, configs: list[AttentionConfig],
          measure: Callable[[AttentionConfig], Result]) -> list[Result]:
    results = []
    for config in configs:
        try:
            results.append(measure(config))
        except Exception as exc:  # noqa: BLE001 - a config past the chip's resources
            print(f"{name} {config_label(config)}: {type(exc).__name__}: {exc}"[:300])
    results.sort(key=lambda r: r.us)
    for r in results[:5]:
        print(f"  {r.name:34s} {r.us:9.1f} us  {r.fraction:6.1%}  {r.note}")
    return results


def decode_requests(n: int, low: int, high: int, seed: int = 1) -> list[tuple[int, int]]:
    g = random.Random(seed)
    return [(g.randint(low, high), 1) for _ in range(n)]


def guarded(results: list[Result], label: str,
            measure: Callable[[], Result | list[Result]]) -> None:
    """Runs one measurement; a failure is printed and the rest of the device call goes on."""
    try:
        out = measure()
    except Exception as exc:  # noqa: BLE001 - any failure: report it, keep the call useful
        print(f"{label}: FAILED {type(exc).__name__}: {exc}"[:600])
        return
    results.extend(out if isinstance(out, list) else [out])


def attention_suite(ceilings: Ceilings) -> list[Result]:
    decode_256 = decode_requests(256, 500, 700)
    decode_1 = [(1000, 1)]
    prefill = [(4096, 2048)]
    mixed = decode_requests(255, 100, 1100) + [(1536, 512)]
    cases = [
        ("attn decode qwen3 256x~600", QWEN3_06B, decode_256, None),
        ("attn decode qwen3 256x~600 @40960", QWEN3_06B, decode_256, 40960),
        ("attn decode llama 1x1000", LLAMA_8B, decode_1, None),
        ("attn decode llama 1x1000 @131072", LLAMA_8B, decode_1, 131072),
        ("attn decode llama 64x~4000", LLAMA_8B, decode_requests(64, 3500, 4500), None),
        ("attn prefill llama 2048 after 2048", LLAMA_8B, prefill, None),
        ("attn prefill qwen3 4x2048", QWEN3_06B, [(2048, 2048)] * 4, None),
        ("attn mixed qwen3 255 dec + 512", QWEN3_06B, mixed, None)]
    results: list[Result] = []
    for name, model, requests, max_seq_len in cases:
        guarded(results, name, lambda: time_attention(name, model, requests, ceilings,
                                                      max_seq_len))
    graphs = [("attn decode llama 1x1000 graph, 1 layer", LLAMA_8B, decode_1, 131072, 1),
              ("attn decode llama 1x1000 graph, per layer of 32", LLAMA_8B, decode_1, 131072,
               32),
              ("attn decode qwen3 256x~600 graph, per layer of 8", QWEN3_06B, decode_256,
               40960, 8)]
    for name, model, requests, max_seq_len, layers in graphs:
        guarded(results, name, lambda: time_graph_decode(name, model, requests, max_seq_len,
                                                         ceilings, layers=layers))
    guarded(results, "torch", lambda: time_torch_decode(
        "torch decode qwen3 256x~600", QWEN3_06B, decode_256, ceilings))
    guarded(results, "host", lambda: host_attention("host: attn decode llama 1x1000",
                                                    LLAMA_8B, decode_1))
    guarded(results, "host", lambda: host_attention("host: attn mixed qwen3 255 dec + 512",
                                                    QWEN3_06B, mixed))
    return results


def window_suite(ceilings: Ceilings) -> list[Result]:
    """Sliding windows and the soft cap against the same launch without them. A window
    should cost the fraction of the context it reads (its blocks are skipped, not
    masked): at 32 x 8000 keys, window 1024 about 1024 / 8000 of the full decode, and
    4096 about half. The cap (Gemma-2's 50) should cost little: a decode is bound by
    reading K and V, not by the tanh on the scores."""
    decodes = [(8000, 1)] * 32
    results: list[Result] = []
    for label, model in (("llama", LLAMA_8B), ("gemma2", GEMMA2_9B)):
        name = f"attn decode {label} 32x8000"
        full = time_attention(name, model, decodes, ceilings)
        results.append(full)
        for window in (1024, 4096):
            windowed = time_attention(f"{name} window {window}", model, decodes, ceilings,
                                      sliding_window=window)
            windowed.note += (f"; {windowed.us / full.us:.3f} of full, keys "
                              f"{window / 8000:.3f} of full")
            results.append(windowed)
        capped = time_attention(f"{name} soft cap 50", model, decodes, ceilings, soft_cap=50.0)
        capped.note += f"; {capped.us / full.us:.3f} of uncapped"
        results.append(capped)
    # a prefill is bound by the work on each score, where the cap's exp2 and division
    # weigh beside the softmax's exp2
    prefill = [(8192, 4096)]
    name = "attn prefill gemma2 4096 after 4096"
    full = time_attention(name, GEMMA2_9B, prefill, ceilings)
    results.append(full)
    for label, window, cap in (("window 4096", 4096, None), ("cap 50", None, 50.0),
                               ("window 4096 cap 50", 4096, 50.0)):
        r = time_attention(f"{name} {label}", GEMMA2_9B, prefill, ceilings,
                           sliding_window=window, soft_cap=cap)
        r.note += f"; {r.us / full.us:.3f} of full"
        results.append(r)
    for r in results:
        print(f"  {r.name:48s} {r.us:9.1f} us  {r.fraction:6.1%}  {r.note}")
    return results


def attention_sweeps(ceilings: Ceilings) -> dict[str, list[Result]]:
    """Launch configs around the defaults, for the cases the targets name."""
    sms = sm_count(0)
    base = default_config(torch.empty(1, device="cuda", dtype=BF16))

    def decode_tile(**changes: int) -> AttentionConfig:
        return replace(base, decode=replace(base.decode, **changes))

    def prefill_tile(**changes: int) -> AttentionConfig:
        return replace(base, prefill=replace(base.prefill, **changes))

    prefill_configs = [prefill_tile(block_m=m, block_n=n, num_warps=w, num_stages=s)
                       for m, n, w, s in [(64, 64, 4, 2), (128, 64, 8, 3)]]
    return {
        "decode qwen3 256x600": sweep("decode qwen3 256x600", [
            decode_tile(block_n=n, num_warps=w, num_stages=s)
            for n, w, s in [(64, 4, 3), (32, 2, 3)]],
            lambda c: time_attention("decode qwen3 256x600", QWEN3_06B,
                                     decode_requests(256, 500, 700), ceilings, config=c)),
        "decode llama 1x1000 graph/layer": sweep("decode llama 1x1000 graph/layer", [
            replace(decode_tile(block_n=n), target_programs=t, min_partition=n)
            for n, t in [(64, 1), (64, sms), (64, 2 * sms), (32, sms)]],
            lambda c: time_graph_decode("decode llama 1x1000 graph/layer", LLAMA_8B,
                                        [(1000, 1)], 131072, ceilings, c, layers=32)),
        "prefill llama 2048 after 2048": sweep(
            "prefill llama 2048 after 2048", prefill_configs,
            lambda c: time_attention("prefill llama 2048 after 2048", LLAMA_8B,
                                     [(4096, 2048)], ceilings, config=c)),
        "prefill qwen3 4x2048": sweep(
            "prefill qwen3 4x2048", prefill_configs,
            lambda c: time_attention("prefill qwen3 4x2048", QWEN3_06B, [(2048, 2048)] * 4,
                                     ceilings, config=c)),
    }


def time_graph_decode(name: str, model: tuple, requests: list[tuple[int, int]],
                      max_seq_len: int, ceilings: Ceilings,
                      config: AttentionConfig | None = None, layers: int = 1) -> Result:
    """Decode attention of `layers` layers captured in one CUDA graph, as the model runner
    will run it: each layer its own K/V cache, the metadata shared; time per layer (the
    L2 is flushed before each replay, so the first layer finds the metadata cold)."""
    batch = attention_batch(model, requests)
    caches = [(batch["k_cache"], batch["v_cache"])] + [
        (torch.randn_like(batch["k_cache"]), torch.randn_like(batch["v_cache"]))
        for _ in range(layers - 1)]

    def step() -> None:
        for k_cache, v_cache in caches:
            paged_attention_triton(**(batch | {"k_cache": k_cache, "v_cache": v_cache}),
                                   max_query_len=1, max_seq_len=max_seq_len, config=config)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    floor, bound = attention_floor_us(model, requests, ceilings)
    used = config or default_config(batch["q"])
    return Result(name, bench_us(graph.replay) / layers, floor,
                  f"{bound}-bound; graph of {layers}; {config_label(used)}")


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host time of one call (launches queued, no sync): what a step outside a CUDA graph
    pays whatever the GPU does."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return us


def host_attention(name: str, model: tuple, requests: list[tuple[int, int]]) -> Result:
    batch = attention_batch(model, requests)
    max_query_len, max_seq_len = max(q for _, q in requests), max(c for c, _ in requests)
    us = host_us(lambda: paged_attention_triton(**batch, max_query_len=max_query_len,
                                                max_seq_len=max_seq_len))
    return Result(name, us, 0.0, "host enqueue time per call, not GPU time")


def time_torch_decode(name: str, model: tuple, requests: list[tuple[int, int]],
                      ceilings: Ceilings) -> Result:
    batch = attention_batch(model, requests)
    us = bench_us(lambda: paged_attention_torch(**batch))
    floor, bound = attention_floor_us(model, requests, ceilings)
    return Result(name, us, floor, f"{bound}-bound; the torch path, for scale")


# --- the small kernels --------------------------------------------------------------------

def small_kernel_suite(ceilings: Ceilings) -> list[Result]:
    heads, kv_heads, head_dim, hidden, inter = LLAMA_8B
    results = []
    for tokens in (256, 8192):
        results += time_small_kernels(tokens, heads, kv_heads, head_dim, hidden, inter,
                                      ceilings)
    return results


def time_small_kernels(tokens: int, heads: int, kv_heads: int, head_dim: int, hidden: int,
                       inter: int, ceilings: Ceilings) -> list[Result]:
    def floor(num_bytes: float) -> float:
        return num_bytes / ceilings.bandwidth * 1e6

    def pair(name: str, triton_fn: Callable, ref_fn: Callable, num_bytes: float) -> Result:
        """The Triton kernel against its floor; the torch reference's time and the host
        enqueue time of the Triton call beside it."""
        return Result(f"{name} T={tokens}", bench_us(triton_fn), floor(num_bytes),
                      f"torch ref {bench_us(ref_fn):.1f} us; host {host_us(triton_fn):.1f} us")

    kv = torch.randn(tokens, 2 * kv_heads, head_dim, device="cuda", dtype=BF16)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    cache = (tokens // 16 * 2 + 1, 16, kv_heads, head_dim)
    k_cache = torch.randn(cache, device="cuda", dtype=BF16)
    v_cache = torch.randn(cache, device="cuda", dtype=BF16)
    slots = torch.randperm(cache[0] * 16, device="cuda")[:tokens]
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    res = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    w = torch.randn(hidden, device="cuda", dtype=BF16)
    rope = rope_cos_sin_cache(head_dim, 8192, 500000.0, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    q_rot = torch.randn(tokens, heads, head_dim, device="cuda", dtype=BF16)
    k_rot = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=BF16)
    gate_up = torch.randn(tokens, 2 * inter, device="cuda", dtype=BF16)
    qk_elems = tokens * (heads + kv_heads) * head_dim
    return [
        pair("write_kv llama", lambda: write_kv_triton(k, v, k_cache, v_cache, slots),
             lambda: write_kv_ref(k, v, k_cache, v_cache, slots),
             2 * 2 * tokens * kv_heads * head_dim * 2),
        pair("rms_norm+res llama", lambda: rms_norm_triton(x, w, 1e-5, res),
             lambda: rms_norm_ref(x, w, 1e-5, res), 4 * tokens * hidden * 2),
        pair("rotary llama", lambda: apply_rotary_triton(positions, q_rot, k_rot, rope),
             lambda: apply_rotary_ref(positions, q_rot, k_rot, rope),
             2 * qk_elems * 2 + tokens * head_dim * 4),
        pair("silu_and_mul llama", lambda: silu_and_mul_triton(gate_up),
             lambda: silu_and_mul_ref(gate_up), 3 * tokens * inter * 2)]


def compiled_report() -> list[str]:
    """Registers, spills and shared memory of each compiled attention variant (triton's
    kernel cache layout differs between versions: report what is there)."""
    lines = []
    try:
        for cache in _paged_attention_kernel.device_caches.values():
            for key, kernel in cache[0].items():
                lines.append(f"regs {kernel.n_regs:3d} spills {kernel.n_spills:3d} "
                             f"smem {kernel.metadata.shared:6d} {str(key)[-160:]}")
    except (AttributeError, TypeError, IndexError) as exc:
        lines.append(f"compiled kernel report unavailable: {exc!r}")
    return lines


def as_json(r: Result) -> dict:
    return asdict(r) | {"fraction": r.fraction}


def print_table(results: list[Result], ceilings: Ceilings, tests: str) -> None:
    print(f"\ntests: {tests}")
    print(f"ceilings: copy {ceilings.bandwidth / 1e12:.2f} TB/s (read+write), "
          f"bf16 matmul {ceilings.matmul / 1e12:.0f} TFLOP/s")
    print(f"{'kernel':48s} {'time us':>9s} {'floor us':>9s} {'of floor':>8s}  note")
    for r in results:
        print(f"{r.name:48s} {r.us:9.1f} {r.floor_us:9.1f} {r.fraction:8.1%}  {r.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--window-only", action="store_true",
                        help="only the sliding-window and soft-cap timings, no tests")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(torch.cuda.get_device_name(), f"{sm_count(0)} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    if args.window_only:
        ceilings = measure_ceilings()
        results: list[Result] = []
        guarded(results, "window", lambda: window_suite(ceilings))
        (args.out / "window.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "ceilings": asdict(ceilings),
             "results": [as_json(r) for r in results]}, indent=1))
        print_table(results, ceilings, "skipped")
        return
    tests = "skipped" if args.skip_tests else run_tests(args.out)
    ceilings = measure_ceilings()
    results = attention_suite(ceilings)
    guarded(results, "window", lambda: window_suite(ceilings))
    guarded(results, "small kernels", lambda: small_kernel_suite(ceilings))
    sweeps = attention_sweeps(ceilings)
    report = compiled_report()
    spilling = [line for line in report if " spills   0 " not in line]
    print(f"\n{len(report)} attention variants compiled; spilling or unreported:",
          *spilling, sep="\n  ")
    print("\nbest of each sweep:")
    for name, rs in sweeps.items():
        if rs:
            print(f"  {name:34s} {rs[0].us:9.1f} us {rs[0].fraction:6.1%}  {rs[0].note}")
    (args.out / "kernels.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "tests": tests,
        "ceilings": asdict(ceilings), "compiled": report,
        "sweeps": {name: [as_json(r) for r in rs] for name, rs in sweeps.items()},
        "results": [as_json(r) for r in results]}, indent=1))
    print_table(results, ceilings, tests)


if __name__ == "__main__":
    main()

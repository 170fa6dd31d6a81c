"""The 16-bit GEMV (kernels/gemv.py) against cuBLAS (F.linear) at the decode projections of
Phi-3-mini-4k, Gemma-2-9B, Llama-3.1-8B and Qwen3-30B-A3B's attention (shapes read from
.devkit/models/*/config.json, TP=1, bf16), at 1, 2, 4, 8 and 16 rows: each way replayed in
a CUDA graph (kernels/graph_timing.py), GB/s of the weight bytes it reads.

Each way cycles through copies of its weights that together pass L2_FLUSH_BYTES, as a decode
step streams every layer's weights once (benchmarks/gpu/fp8_gemv_sweep.py does the same).

    source .devkit/env.sh && python benchmarks/gpu/gemv_sweep.py

A line per shape and row count: cuBLAS, the tiles the layer runs now (kernels/gemv.tiles_for:
TUNED_TILES, else default_tiles), then the fastest candidates. The last lines are the
TUNED_TILES entries to paste into kernels/gemv.py: each shape and row count whose best
candidate beat the current tiles by 3% or more. Whether a layer takes the kernel at all is
decided at load time (services/worker/layers/gemv_choice.py), so an entry slower than cuBLAS
does no harm. Past BUDGET_S only cuBLAS and the current tiles are timed (it stays under
four minutes on an H100).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the project root

from benchmarks.gpu.fp8_gemv_sweep import copies, describe  # noqa: E402
from kernels.gemv import GemvTiles, gemv_triton, sm_count, tiles_for  # noqa: E402
from kernels.graph_timing import graph_us  # noqa: E402

MODELS = ("phi-3-mini-4k", "gemma-2-9b", "llama-3.1-8b", "qwen3-30b-a3b")
ROWS = (1, 2, 4, 8, 16)
BUDGET_S = 200
ONE_ROW = [GemvTiles(n, k, split_k=s, num_warps=w, num_stages=1)
           for n in (4, 8, 16) for k in (128, 256, 512) for w in (4, 8) for s in (1, 2)]
ONE_ROW_DOT = [GemvTiles(n, k, dot=True, split_k=s, num_stages=3)
               for n in (16, 32) for k in (64, 128) for s in (1, 2)]
DOT = [GemvTiles(n, k, dot=True, split_k=s, num_stages=st)
       for n in (16, 32, 64) for k in (64, 128, 256) for st in (3, 4) for s in (1, 2)]


def projections(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection; a mixture of experts' attention only (its experts take
    the fused MoE kernel)."""
    config = AutoConfig.from_pretrained(ROOT / ".devkit" / "models" / f"{model}-shape")
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"qkv": (q + 2 * kv, hidden), "o": (hidden, q)}
    if getattr(config, "num_experts", None) is None:
        inter = config.intermediate_size
        shapes |= {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    return shapes


def fastest(x: torch.Tensor, weights, configs: list[GemvTiles]
            ) -> list[tuple[float, GemvTiles]]:
    timed = []
    for tiles in configs:
        try:
            us = graph_us(lambda t=tiles: gemv_triton(x, next(weights)[0], tiles=t))
        except Exception as exc:  # noqa: BLE001 - a config past the chip's resources
            print(f"    {describe(tiles)}: {exc}"[:160])
            continue
        timed.append((us, tiles))
    return sorted(timed, key=lambda row: row[0])


def sweep(label: str, n: int, k: int, rows: int, weights, deadline: float
          ) -> tuple[tuple[int, int, int, int], GemvTiles] | None:
    """Prints one line (and the fastest candidates); the TUNED_TILES entry its best
    candidate earns, if any."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    gb = n * k * 2 / 1e3  # weight bytes / 1e3: over microseconds gives GB/s
    cublas_us = graph_us(lambda: F.linear(x, next(weights)[0]))
    sms = sm_count(x.device)
    current = tiles_for(rows, n, k, sms)
    current_us = graph_us(lambda: gemv_triton(x, next(weights)[0]))
    print(f"{label} N {n} K {k} M {rows}: cuBLAS {cublas_us:.1f} us ({gb / cublas_us:.0f} "
          f"GB/s) | GEMV now [{describe(current)}] {current_us:.1f} us "
          f"({gb / current_us:.0f} GB/s)", flush=True)
    if time.monotonic() > deadline:
        return None
    timed = fastest(x, weights, ONE_ROW + ONE_ROW_DOT if rows == 1 else DOT)
    for us, tiles in timed[:4]:
        print(f"  {describe(tiles)}: {us:7.1f} us {gb / us:6.0f} GB/s"
              f"{'  beats cuBLAS' if us < cublas_us else ''}")
    if timed and timed[0][0] < 0.97 * current_us:
        return (rows, n, k, sms), timed[0][1]
    return None


def main() -> None:
    start = time.monotonic()
    deadline = start + BUDGET_S
    print(f"{torch.cuda.get_device_name()}, {sm_count(torch.device('cuda'))} SMs")
    entries = {}
    for model in MODELS:
        for name, (n, k) in projections(model).items():
            weights = copies(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5)
            for rows in ROWS:
                entry = sweep(f"{model} {name}", n, k, rows, weights, deadline)
                if entry:
                    entries[entry[0]] = entry[1]
            del weights
            torch.cuda.empty_cache()
    print(f"# {time.monotonic() - start:.0f} s; TUNED_TILES entries for kernels/gemv.py:")
    for key, tiles in entries.items():
        print(f"    {key}: {tiles!r},")


if __name__ == "__main__":
    main()

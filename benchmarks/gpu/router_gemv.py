"""A MoE router's projection at decode sizes (Qwen3-30B-A3B: 128 experts x 2048, Mixtral:
8 x 4096): cuBLAS against the 16-bit GEMV's tiles, each in a CUDA graph cycling through 48
layers' weights as a decode step does.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/router_gemv.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.gemv import GemvTiles, gemv_triton, tiles_for
from kernels.graph_timing import graph_us

LAYERS = 48


def timed(fn, weights: list[torch.Tensor]) -> float:
    cycle = itertools.cycle(weights)
    return graph_us(lambda: fn(next(cycle)), calls=LAYERS, replays=10)


def main() -> None:
    for n, k in ((128, 2048), (8, 4096)):
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        for rows in (1, 2):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cublas = timed(lambda w: F.linear(x, w), weights)
            default = tiles_for(rows, n, k, 132)
            candidates = [default] + [
                GemvTiles(bn, bk, dot=rows > 1, split_k=s, num_warps=w, num_stages=1)
                for bn in (2, 4, 8, 16) for bk in (128, 256, 512) for s in (1, 2, 4)
                for w in (2, 4) if rows == 1 or bn >= 16]
            results = sorted((timed(lambda w, t=t: gemv_triton(x, w, tiles=t), weights), t)
                             for t in candidates)
            best = "; ".join(f"{us:.2f} {t}" for us, t in results[:4])
            print(f"N {n} K {k} rows {rows}: cuBLAS {cublas:.2f} us, default tiles "
                  f"{timed(lambda w: gemv_triton(x, w, tiles=default), weights):.2f} us; "
                  f"best {best}")


if __name__ == "__main__":
    main()

"""The fp8 W8A8 GEMM of decode batches past the GEMV's 16 rows (per-token activation scales,
per-channel weight scales) at Llama-3.1-8B's projections: cuBLAS's rowwise `torch._scaled_mm`
against the Triton kernel (kernels/quant.py) at each tile, replayed in CUDA graphs. GB/s
counts the fp8 weight bytes.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/fp8_gemm_sweep.py [ROWS ...]
"""

from __future__ import annotations

import sys

import torch

from benchmarks.gpu.graph_timing import graph_us
from kernels.quant import FP8_DTYPE, ScaledMmTiles, quantize_per_token, scaled_mm, \
    scaled_mm_triton

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
CANDIDATES = [ScaledMmTiles(bm, bn, bk, w, s) for bm in (32, 64) for bn in (32, 64, 128)
              for bk in (128, 256) for w in (4,) for s in (3, 5)]


def main(rows_list: list[int]) -> None:
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * 0.05).to(FP8_DTYPE)
        w_scale = torch.rand(n, 1, device="cuda") * 0.01
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, a_scale = quantize_per_token(x, FP8_DTYPE)
            cublas = graph_us(lambda: scaled_mm(a, a_scale, w, w_scale, 1, k, torch.bfloat16))
            rows = []
            for tiles in CANDIDATES:
                if tiles.block_m > max(16, m) * 2:
                    continue
                try:
                    us = graph_us(lambda t=tiles: scaled_mm_triton(
                        a, a_scale, w, w_scale, 1, k, torch.bfloat16, tiles=t))
                except Exception as exc:  # noqa: BLE001 - past the chip's resources
                    print(f"{name} m{m} {tiles}: {exc}"[:160])
                    continue
                rows.append((us, tiles))
            rows.sort(key=lambda row: row[0])
            print(f"{name} K {k} N {n} rows {m}: cuBLAS {cublas:.1f} us "
                  f"({n * k / cublas / 1e3:.0f} GB/s)")
            for us, t in rows[:6]:
                print(f"  {t}: {us:.1f} us ({n * k / us / 1e3:.0f} GB/s)")
            sys.stdout.flush()


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or [64])

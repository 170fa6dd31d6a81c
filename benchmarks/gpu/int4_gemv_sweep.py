"""The W4A16 GEMV's tiles at Llama-3.1-8B's projections (group 128, one row of x): each
config replayed in a CUDA graph, against cuBLAS's bf16 GEMV of the same shape; GB/s of
the int4 weights, scales and zeros read.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/int4_gemv_sweep.py
"""

from __future__ import annotations

import torch

from benchmarks.gpu.graph_timing import graph_us
from kernels.int4 import Int4Tiles, w4a16_gemm_triton

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
GROUP = 128
CONFIGS = [Int4Tiles(1, n, k, w, 2) for n in (8, 16, 32, 64) for k in (256, 512, 1024)
           for w in (2, 4, 8)]


def main() -> None:
    for name, (k, n) in SHAPES.items():
        qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32,
                                device="cuda")
        scales = torch.rand(k // GROUP, n, device="cuda", dtype=torch.bfloat16) * 0.01
        zeros = torch.full((k // GROUP, n), 8, dtype=torch.uint8, device="cuda")
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        nbytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
        bf16_us = graph_us(lambda: x @ dense.T)
        rows = []
        for tiles in CONFIGS:
            try:
                us = graph_us(lambda t=tiles: w4a16_gemm_triton(x, qweight, scales, zeros,
                                                                GROUP, tiles=t))
            except Exception as exc:  # noqa: BLE001 - a config past the chip's resources
                print(f"{name} {tiles}: {exc}"[:160])
                continue
            rows.append((us, tiles))
        rows.sort(key=lambda row: row[0])
        print(f"{name} K {k} N {n}: cuBLAS bf16 {bf16_us:.1f} us "
              f"({dense.numel() * 2 / bf16_us / 1e3:.0f} GB/s)")
        for us, t in rows[:8] + rows[-2:]:
            print(f"  n{t.block_n:<4d} k{t.block_k:<4d} w{t.num_warps} s{t.num_stages}: "
                  f"{us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s")


if __name__ == "__main__":
    main()

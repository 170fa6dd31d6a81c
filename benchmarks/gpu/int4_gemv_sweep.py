"""The W4A16 kernels' tiles at Llama-3.1-8B's projections (group 128), each config replayed
in a CUDA graph, against cuBLAS's bf16 matmul of the same shape: the GEMV at one row
(GB/s of the int4 weights, scales and zeros read), the tiled GEMM at 8 and 16 rows (decode
batches), and dequantize + cuBLAS at 256 and 2048 (prefill, TFLOP/s).

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/int4_gemv_sweep.py
"""

from __future__ import annotations

import sys

import torch

from benchmarks.gpu.graph_timing import graph_us
from kernels.gemv import sm_count
from kernels.int4 import Int4Tiles, default_tiles, w4a16_gemm_triton

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
GROUP = 128
CONFIGS = {
    # K tiles over several groups: each row's words read in runs of 256-512 bytes
    1: [Int4Tiles(1, n, kk, w, 1, split) for n in (8, 16, 32, 64) for kk in (512, 1024)
        for w in (4, 8) for split in (1, 2)] + [Int4Tiles(1, 128, 128, 4, 1)],
    8: [Int4Tiles(16, n, 128, 4, s, split) for n in (64, 128) for s in (2, 3)
        for split in (1, 2, 4)],
    256: [],
    2048: [Int4Tiles(128, 256, 64, 8, 3)],  # the fused GEMM's best, against dequantize + cuBLAS
}
CONFIGS[16] = CONFIGS[8]


def main(rows_list: list[int]) -> None:
    for name, (k, n) in SHAPES.items():
        qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32,
                                device="cuda")
        scales = torch.rand(n, k // GROUP, device="cuda", dtype=torch.bfloat16) * 0.01
        zeros = torch.full((n, k // GROUP), 8, dtype=torch.uint8, device="cuda")
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        nbytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = graph_us(lambda: x @ dense.T)
            rows = []
            for tiles in CONFIGS[m]:
                try:
                    us = graph_us(lambda t=tiles: w4a16_gemm_triton(x, qweight, scales, zeros,
                                                                    GROUP, tiles=t))
                except Exception as exc:  # noqa: BLE001 - a config past the chip's resources
                    print(f"{name} m{m} {tiles}: {exc}"[:160])
                    continue
                rows.append((us, tiles))
            default_us = graph_us(lambda: w4a16_gemm_triton(x, qweight, scales, zeros, GROUP))
            rows.sort(key=lambda row: row[0])
            flops = 2 * m * n * k
            print(f"{name} K {k} N {n} rows {m}: cuBLAS bf16 {bf16_us:.1f} us, default "
                  f"{default_tiles(m, n, k, sm_count(x.device))} {default_us:.1f} us "
                  f"({nbytes / default_us / 1e3:.0f} GB/s, {flops / default_us / 1e6:.0f} TF/s)")
            for us, t in rows[:10] + rows[-2:]:
                print(f"  m{t.block_m:<3d} n{t.block_n:<4d} k{t.block_k:<4d} w{t.num_warps} "
                      f"s{t.num_stages} split {t.split_k}: {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s "
                      f"{flops / us / 1e6:5.0f} TF/s")
            sys.stdout.flush()


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or [1, 8, 256, 2048])

"""The fp8 weight-only GEMV (kernels/fp8_gemv.py) at Llama-3.1-8B's projections, 1 and 8
rows of bf16 x, per-channel scales: each way replayed in a CUDA graph, against cuBLAS's
bf16 GEMM of the same shape and the W8A8 path it replaces (the per-token activation
quantize, then torch._scaled_mm); GB/s of the weight bytes each reads. The GEMV's default
tiles (what the layer runs) come first, then every other config, fastest first.

Each way cycles through copies of its weights that together pass L2_FLUSH_BYTES, as a decode
step streams every layer's weights once: the 8B's o and qkv weights (16 and 25 MB in fp8)
would otherwise stay in the H100's 50 MB L2 from one replay to the next.

    source .devkit/env.sh && python benchmarks/gpu/fp8_gemv_sweep.py [ROWS...]

Also times 128x128 block scales at one row (DeepSeek-style checkpoints) with the default
tiles.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

from benchmarks.gpu.graph_timing import graph_us  # noqa: E402
from kernels.fp8_gemv import fp8_gemv_triton  # noqa: E402
from kernels.gemv import GemvTiles, default_tiles, sm_count  # noqa: E402
from kernels.quant import FP8_DTYPE, quantize_per_token, scaled_mm  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}  # (K, N)
ROWS = (1, 8)
L2_FLUSH_BYTES = 256 * 2 ** 20
ONE_ROW = [GemvTiles(n, k, split_k=s, num_warps=w, num_stages=1)
           for n in (2, 4, 8, 16, 32) for k in (256, 512, 1024, 2048) for w in (4, 8)
           for s in (1, 2)]
DOT = [GemvTiles(n, k, dot=True, split_k=s, num_warps=w, num_stages=st)
       for n in (16, 32, 64) for k in (128, 256) for w in (4,) for st in (3, 4, 5)
       for s in (1, 2)]


def describe(t: GemvTiles) -> str:
    kind = "dot" if t.dot else "fma"
    return (f"{kind} n{t.block_n:<3d} k{t.block_k:<5d} split{t.split_k} w{t.num_warps} "
            f"s{t.num_stages}")


def copies(*tensors: torch.Tensor) -> itertools.cycle:
    """Enough copies of tensors to pass L2_FLUSH_BYTES, in a cycle (the first: themselves)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    count = max(1, math.ceil(L2_FLUSH_BYTES / nbytes))
    return itertools.cycle([tensors] + [tuple(t.clone() for t in tensors)
                                        for _ in range(count - 1)])


def time_configs(x: torch.Tensor, weights: itertools.cycle,
                 configs: list[GemvTiles]) -> list[tuple[float, GemvTiles]]:
    rows = []
    for tiles in configs:
        try:
            us = graph_us(lambda t=tiles: fp8_gemv_triton(x, *next(weights), tiles=t))
        except Exception as exc:  # noqa: BLE001 - a config past the chip's resources
            print(f"    {describe(tiles)}: {exc}"[:160])
            continue
        rows.append((us, tiles))
    return sorted(rows, key=lambda row: row[0])


def sweep(name: str, k: int, n: int, rows: int) -> None:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    w, scale = quantize_per_token(dense, FP8_DTYPE)  # per output channel, [N, 1]
    fp8_bytes = w.numel() + scale.numel() * 4
    dense_copies, fp8_copies = copies(dense), copies(w, scale)
    bf16_us = graph_us(lambda: x @ next(dense_copies)[0].T)

    def w8a8() -> torch.Tensor:
        q, q_scale = quantize_per_token(x, FP8_DTYPE)
        w_i, scale_i = next(fp8_copies)
        return scaled_mm(q, q_scale, w_i, scale_i, 1, k, torch.bfloat16)

    w8a8_us = graph_us(w8a8)
    default = default_tiles(rows, n, k, sm_count(x.device), 1, k)
    default_us = graph_us(lambda: fp8_gemv_triton(x, *next(fp8_copies)))
    print(f"{name} K {k} N {n} M {rows}: cuBLAS bf16 {bf16_us:.1f} us "
          f"({dense.numel() * 2 / bf16_us / 1e3:.0f} GB/s) | quantize + _scaled_mm "
          f"{w8a8_us:.1f} us ({fp8_bytes / w8a8_us / 1e3:.0f} GB/s) | fp8 GEMV default "
          f"[{describe(default)}] {default_us:.1f} us ({fp8_bytes / default_us / 1e3:.0f} GB/s)")
    configs = ONE_ROW + DOT if rows == 1 else DOT
    timed = time_configs(x, fp8_copies, configs)
    for us, t in timed if len(timed) <= 8 else timed[:6] + timed[-2:]:
        print(f"  {describe(t)}: {us:7.1f} us {fp8_bytes / us / 1e3:6.0f} GB/s")


def blocks_at_one_row(name: str, k: int, n: int) -> None:
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(n // 128, k // 128, device="cuda") / 64
    cycle = copies(w, scale)
    us = graph_us(lambda: fp8_gemv_triton(x, *next(cycle), block=(128, 128)))
    default = default_tiles(1, n, k, sm_count(x.device), 1, 128)
    print(f"{name} K {k} N {n} M 1, 128x128 blocks: fp8 GEMV default [{describe(default)}] "
          f"{us:.1f} us "
          f"({(w.numel() + scale.numel() * 4) / us / 1e3:.0f} GB/s)")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, {sm_count(torch.device('cuda'))} SMs")
    for rows in [int(arg) for arg in sys.argv[1:]] or ROWS:
        for name, (k, n) in SHAPES.items():
            sweep(name, k, n, rows)
    for name, (k, n) in SHAPES.items():
        blocks_at_one_row(name, k, n)


if __name__ == "__main__":
    main()

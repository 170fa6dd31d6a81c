"""fp8 weights times 16-bit activations for decode batches (w8a16): y = x @ dequant(w)^T for
x of at most GEMV_MAX_ROWS rows in bf16 or fp16, w [N, K] float8_e4m3fn row-major.

The activations are not quantized: at a few rows the weight read is all the work, so the
W8A8 path's per-token quantize (one more launch) and cuBLAS's rowwise fp8 GEMM (far from
memory bandwidth at one row) buy nothing. Every fp8 weight value is exact in bf16 and fp16,
so the products are exact and only the float32 sums round.

Scales come as blocks: w_scale [ceil(N / block_n), ceil(K / block_k)] covers one scale per
tensor (block (N, K), scale [1, 1]), per output channel (block (1, K), scale [N, 1]) and
DeepSeek-style 128 x 128 blocks. A scale that spans all of K multiplies each output once
after the loop; a K-blocked scale multiplies each K tile (its weights on the CUDA cores, its
dot's sums on tensor cores), so a K tile never straddles two scale blocks (BLOCK_K is
narrowed to divide block_k).

The kernel, its tiles and their rules are the 16-bit GEMV's (kernels/gemv.py) at one byte a
weight; benchmarks/gpu/fp8_gemv_sweep.py times the alternatives. The torch twin dequantizes
to float32 and multiplies.
"""

from __future__ import annotations

import torch
import triton

from kernels.gemv import GemvTiles, default_tiles, launch_gemv, sm_count
from kernels.quant import FP8_DTYPE, dequantize

# (rows, N, K, SMs) -> tiles for scales that span all of K (per tensor, per channel): the
# best of benchmarks/gpu/fp8_gemv_sweep.py where they beat the rules' by 3% or more, on an
# H100 80GB HBM3 (132 SMs), 2026-11-27 (benchmarks/issue30-h100/s4/fp8-gemv-sweep-1row.txt):
# Llama-3.1-8B's projections at one row, 8 warps on 512-1024-byte rows, and gate_up on
# tensor cores at 32 x 256 bytes, 4 stages (default 14.4, 9.0, 51.9, 26.2 us)
TUNED_TILES: dict[tuple[int, int, int, int], GemvTiles] = {
    (1, 6144, 4096, 132): GemvTiles(8, 1024, False, 1, 8, 1),  # 12.0 us
    (1, 4096, 4096, 132): GemvTiles(8, 512, False, 1, 8, 1),  # 8.5 us
    (1, 28672, 4096, 132): GemvTiles(32, 256, True, 1, 4, 4),  # 45.0 us
    (1, 4096, 14336, 132): GemvTiles(8, 512, False, 1, 8, 1),  # 24.6 us
}


# --- torch reference twin ------------------------------------------------------------------

def scale_blocks(w_scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None
                 ) -> tuple[torch.Tensor, int, int]:
    """The scale as float32 blocks [ceil(N / block_n), ceil(K / block_k)] and the block
    shape; block None reads a one-element scale as per tensor, N elements as per channel."""
    if block is None:
        if w_scale.numel() == 1:
            block = (n, k)
        elif w_scale.numel() == n:
            block = (1, k)
        else:
            raise ValueError(f"fp8_gemv: a scale of {tuple(w_scale.shape)} for a [{n}, {k}] "
                             "weight needs its block shape")
    block_n, block_k = min(block[0], n), min(block[1], k)
    shape = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    if w_scale.numel() != shape[0] * shape[1]:
        raise ValueError(f"fp8_gemv: {tuple(w_scale.shape)} scales do not cover a [{n}, {k}] "
                         f"weight in {block_n}x{block_k} blocks ({shape} expected)")
    return w_scale.reshape(shape).float().contiguous(), block_n, block_k


def fp8_gemv_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, block: tuple[int, int] | None = None
                 ) -> torch.Tensor:
    """Dequantize to float32, one float32 matmul (+ bias), the result in x's dtype."""
    n, k = w_fp8.shape
    scale, block_n, block_k = scale_blocks(w_scale, n, k, block)
    y = x.float() @ dequantize(w_fp8, scale, block_n, block_k).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --- dispatch ------------------------------------------------------------------------------

def fp8_gemv(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, block: tuple[int, int] | None = None
             ) -> torch.Tensor:
    """x [..., K] (at most GEMV_MAX_ROWS rows) -> [..., N]. The one dispatch point: CUDA
    tensors take the Triton kernel, others the twin."""
    if x.is_cuda:
        return fp8_gemv_triton(x, w_fp8, w_scale, bias, block)
    return fp8_gemv_ref(x, w_fp8, w_scale, bias, block)


def fp8_gemv_triton(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                    tiles: GemvTiles | None = None) -> torch.Tensor:
    """tiles: force these tiles (the sweep); default: default_tiles by the shape."""
    n, k = w_fp8.shape
    assert w_fp8.dtype == FP8_DTYPE, "e4m3 weights"
    scale, block_n, block_k = scale_blocks(w_scale, n, k, block)
    rows, sms = max(1, x.numel() // k), sm_count(x.device)
    tuned = TUNED_TILES.get((rows, n, k, sms)) if block_k == k else None
    tiles = tiles or tuned or default_tiles(rows, n, k, sms, 1, block_k)
    return launch_gemv(x, w_fp8, bias, tiles, scale, (block_n, block_k))

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

One row on CUDA takes a kernel of its own, because there the GEMV is bound by its
arithmetic, not its reads (benchmarks/gpu/fp8_packed_experiment.py: the loads alone ran
1.4-2x faster than the whole loop on an H200): it reads the weights as words of four, turns
each half word into an fp16 pair with one CVT (e4m3 converts exactly), multiplies them with
the activations in packed fp16 and widens only each word's sum to float32. The four
activations a word meets are scaled by the power of two that puts their largest in
[2^3, 2^4), so that a product (|w| <= 448) and the word's sum stay inside fp16, and the
sum is scaled back: the error stays that of fp16's rounding of the products, under the
twin's bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import GemvTiles, default_tiles, launch_gemv, sm_count
from kernels.norm_seam import (ResidualSum, SeamNorm, new_residual_sum, residual_sum_ref,
                               seam_add, seam_arguments, seam_input_ref, seam_inv_rms,
                               seam_tensor, seam_weigh)
from kernels.packed_half import half_pair, power_of_two_scales
from kernels.pdl import let_next_start, pdl_launch, wait_for_previous
from kernels.quant import FP8_DTYPE, dequantize


@dataclass(frozen=True, slots=True)
class PackedTiles:
    """The one-row packed kernel's tiles: block_n outputs x block_k inputs a step."""
    block_n: int
    block_k: int
    num_warps: int = 4


# 16 outputs x 512 inputs, and where the H200 sweep (benchmarks/gpu/fp8_packed_experiment.py,
# benchmarks/issue30-h100/s6/fp8) found better at Llama-3.1-8B's projections, its tiles
# (the one-row tiles the shared GEMV took before: benchmarks/issue30-h100/s4)
PACKED_TILES = PackedTiles(16, 512)
TUNED_PACKED_TILES: dict[tuple[int, int, int], PackedTiles] = {
    (4096, 14336, 132): PackedTiles(8, 1024, num_warps=8),
}
# $1 a word of four e4m3 weights; $2, $3 the activation pairs (x0, x1) and (x2, x3) as
# f16x2; out: the word's four products summed, in float32
WORD_SUM_ASM = tl.constexpr("""
{
.reg .b16 lo, hi, a, b;
.reg .b32 p0, p1, acc;
.reg .f32 fa, fb;
mov.b32 {lo, hi}, $1;
cvt.rn.f16x2.e4m3x2 p0, lo;
cvt.rn.f16x2.e4m3x2 p1, hi;
mul.rn.f16x2 acc, p0, $2;
fma.rn.f16x2 acc, p1, $3, acc;
mov.b32 {a, b}, acc;
cvt.f32.f16 fa, a;
cvt.f32.f16 fb, b;
add.f32 $0, fa, fb;
}
""")


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


def fp8_gemv_ref(x: torch.Tensor | SeamNorm, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                 add_to: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """Dequantize to float32, one float32 matmul (+ bias), the result in x's dtype; a
    norm seam as gemv_ref's."""
    x = seam_input_ref(x)
    n, k = w_fp8.shape
    scale, block_n, block_k = scale_blocks(w_scale, n, k, block)
    y = x.float() @ dequantize(w_fp8, scale, block_n, block_k).T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if add_to is None else residual_sum_ref(y, add_to)


# --- dispatch ------------------------------------------------------------------------------

def fp8_gemv(x: torch.Tensor | SeamNorm, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
             add_to: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """x [..., K] (at most GEMV_MAX_ROWS rows) -> [..., N]; a norm seam as gemv's (one
    row). The one dispatch point: CUDA tensors take the Triton kernel, others the twin."""
    if seam_tensor(x).is_cuda:
        return fp8_gemv_triton(x, w_fp8, w_scale, bias, block, add_to=add_to)
    return fp8_gemv_ref(x, w_fp8, w_scale, bias, block, add_to)


def fp8_gemv_triton(x: torch.Tensor | SeamNorm, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                    tiles: GemvTiles | PackedTiles | None = None,
                    add_to: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """tiles: force these tiles (the sweep; PackedTiles: the packed kernel, CUDA only);
    default: the packed kernel for one row on CUDA, else default_tiles by the shape."""
    n, k = w_fp8.shape
    assert w_fp8.dtype == FP8_DTYPE, "e4m3 weights"
    scale, block_n, block_k = scale_blocks(w_scale, n, k, block)
    rows_in = seam_tensor(x)
    rows, sms = max(1, rows_in.numel() // k), sm_count(rows_in.device)
    if isinstance(tiles, PackedTiles) or (tiles is None and takes_packed(rows_in, w_fp8, rows)):
        tiles = tiles or TUNED_PACKED_TILES.get((n, k, sms), PACKED_TILES)
        return launch_packed(x, w_fp8, bias, tiles, scale, (block_n, block_k), add_to)
    tiles = tiles or default_tiles(rows, n, k, sms, 1, block_k)
    return launch_gemv(x, w_fp8, bias, tiles, scale, (block_n, block_k), add_to)


def takes_packed(x: torch.Tensor, w_fp8: torch.Tensor, rows: int) -> bool:
    """One row on CUDA (the interpreter has no inline assembly), weights readable as
    words of four."""
    return (rows == 1 and x.is_cuda and w_fp8.shape[1] % 4 == 0 and w_fp8.is_contiguous())


def launch_packed(x: torch.Tensor | SeamNorm, w_fp8: torch.Tensor, bias: torch.Tensor | None,
                  tiles: PackedTiles, scale: torch.Tensor, scale_block: tuple[int, int],
                  add_to: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """The packed kernel for one row x [..., K]; scale as launch_gemv takes it, and so a
    norm seam."""
    norm = x if isinstance(x, SeamNorm) else None
    x = seam_tensor(x)
    n, k = w_fp8.shape
    x1 = x.reshape(1, k).contiguous()
    stripes = triton.cdiv(n, tiles.block_n)
    result = None if add_to is None else new_residual_sum(add_to.reshape(1, n), stripes)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if result is None else result.total
    block_n, block_k = scale_block
    tile_k, per_k = tiles.block_k, block_k < k
    if per_k:  # a K tile inside one scale block, as launch_gemv's
        tile_k = min(tile_k, block_k & -block_k)
        assert tile_k >= 16, f"fp8_gemv: K blocks of {block_k} split into no tile of 16+"
    seam, block_p = seam_arguments(norm, add_to, result, y)
    _packed_row_kernel[(stripes,)](
        x1, w_fp8.view(torch.int32), scale, bias if bias is not None else y, y, n, k,
        scale.shape[1], block_n, block_k, *seam,
        PER_K_SCALE=per_k, HAS_BIAS=bias is not None, NORM_IN=norm is not None,
        ADD_RESIDUAL=result is not None, BLOCK_P=block_p, BLOCK_N=tiles.block_n,
        BLOCK_K=tile_k, num_warps=tiles.num_warps, num_stages=1, **pdl_launch(x))
    return result if result is not None else y.reshape(*x.shape[:-1], n)


# --- kernels -------------------------------------------------------------------------------

@triton.jit
def _packed_word_sums(words, x4, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each word's four weights times x4's row of four ([BLOCK_K / 4, 4] in float32),
    summed: [BLOCK_N, BLOCK_K / 4] float32 (the module's docstring)."""
    up, down = power_of_two_scales(tl.max(tl.abs(x4), axis=1), 3)
    x_even, x_odd = tl.split(tl.reshape(x4 * up[:, None], (BLOCK_K // 4, 2, 2)))
    x0, x2 = tl.split(x_even)
    x1, x3 = tl.split(x_odd)
    shape: tl.constexpr = (BLOCK_N, BLOCK_K // 4)
    sums = tl.inline_asm_elementwise(
        WORD_SUM_ASM, "=r,r,r,r",
        [words, tl.broadcast_to(half_pair(x0, x1)[None, :], shape),
         tl.broadcast_to(half_pair(x2, x3)[None, :], shape)],
        dtype=tl.int32, is_pure=True, pack=1)
    return sums.to(tl.float32, bitcast=True) * down[None, :]


@triton.jit
def _packed_row_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, n, k, scale_stride,
                       scale_block_n, scale_block_k, res_ptr, sumsq_ptr, norm_w_ptr, parts,
                       eps, PER_K_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       NORM_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
    """y = x w^T for one row and a BLOCK_N stripe of w (int32 words of four e4m3, [N,
    K / 4]) over all of K, scaled per K tile or once after the loop. As the 16-bit GEMV's
    one-row loop: per-lane sums reduced once, the next tile loaded before the current
    one's arithmetic, the first weights before waiting on the previous kernel; and its
    norm seam (NORM_IN, ADD_RESIDUAL: kernels/norm_seam.py)."""
    let_next_start(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    cols = tl.arange(0, BLOCK_K // 4)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * (k // 4) + cols[None, :]
    x_at = cols[:, None] * 4 + tl.arange(0, 4)[None, :]
    scale_rows = scale_ptr + (offs_n // scale_block_n) * scale_stride
    lanes = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    words = tl.load(w_rows, mask=n_ok[:, None] & (cols < k // 4)[None, :], other=0)
    # constants too: loaded now, they add no round trip after the loop
    if not PER_K_SCALE:
        scale = tl.load(scale_rows, mask=n_ok, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if NORM_IN:
        norm_w = tl.load(norm_w_ptr + x_at, mask=x_at < k, other=0.0)
    wait_for_previous(PDL)
    residual = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0) if ADD_RESIDUAL else 0.0
    x4 = tl.load(x_ptr + x_at, mask=x_at < k, other=0.0)
    inv_rms = seam_inv_rms(sumsq_ptr, parts, k, eps, BLOCK_P) if NORM_IN else 1.0
    for k0 in range(0, k, BLOCK_K):
        k_next = k0 + BLOCK_K
        next_words = tl.load(w_rows + k_next // 4,
                             mask=n_ok[:, None] & (k_next // 4 + cols < k // 4)[None, :],
                             other=0)
        next_x4 = tl.load(x_ptr + k_next + x_at, mask=k_next + x_at < k, other=0.0)
        if NORM_IN:
            next_norm_w = tl.load(norm_w_ptr + k_next + x_at, mask=k_next + x_at < k,
                                  other=0.0)
            x4 = seam_weigh(x4, norm_w, inv_rms)
            norm_w = next_norm_w
        sums = _packed_word_sums(words, x4.to(tl.float32), BLOCK_N, BLOCK_K)
        if PER_K_SCALE:
            sums *= tl.load(scale_rows + k0 // scale_block_k, mask=n_ok, other=0.0)[:, None]
        lanes += sums
        words, x4 = next_words, next_x4
    acc = tl.sum(lanes, axis=1)
    if not PER_K_SCALE:
        acc *= scale
    if HAS_BIAS:
        acc += bias
    if ADD_RESIDUAL:
        seam_add(acc, residual, out_ptr, offs_n, n_ok, sumsq_ptr + tl.program_id(0))
    else:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

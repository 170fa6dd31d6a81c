"""The GEMV of decode batches: y = x @ w^T (+ bias) for x of at most GEMV_MAX_ROWS rows in
bf16 or fp16 and w [N, K] row-major, 16-bit (here, in x's dtype) or fp8 with block scales
(kernels/fp8_gemv.py feeds the same kernel its scales). At a few rows the weight read is all
the work: cuBLAS reaches 1.6-2.7 TB/s of the H100's ~3.3 there (benchmarks/issue29-h100),
so the unquantized linear layer times this kernel against it per weight shape at load time
and keeps the faster (services/worker/layers/gemv_choice.py).

Each program owns a BLOCK_N stripe of outputs and a share of K: it loads [BLOCK_N, BLOCK_K]
weight tiles contiguous along K and either sums products on the CUDA cores (one row: each
lane keeps its own sums in the tile's layout, reduced once after the loop, and the next
tile's loads go out before the current one's arithmetic) or feeds tl.dot with x padded to
16 rows (more rows). When N is small for the chip, K splits across programs (split_k), each
writing float32 partial sums that a second launch adds up (with the bias) in x's dtype.

A scale, when there is one, comes as blocks [ceil(N / scale_block_n), ceil(K /
scale_block_k)]; a block that spans all of K multiplies each output once after the loop, a
K-blocked one each K tile (BLOCK_K then divides scale_block_k).

The tiles come from a table keyed by the rows, N, K and the SM count (TUNED_TILES, pasted
from benchmarks/gpu/gemv_sweep.py), else from rules scaled to the weight's bytes
(default_tiles), never from runtime autotuning, so a step replays in a CUDA graph. The torch
twin multiplies in float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.norm_seam import (ResidualSum, SeamNorm, new_residual_sum, residual_sum_ref,
                               seam_add, seam_arguments, seam_input_ref, seam_inv_rms,
                               seam_tensor, seam_weigh)
from kernels.pdl import let_next_start, overlap_previous, pdl_launch, wait_for_previous

GEMV_MAX_ROWS = 16
DOT_MIN_ROWS = 16  # tl.dot's smallest M: fewer rows are padded with masked loads
SUM_BLOCK = 1024  # outputs a program of the split's sum adds up


@dataclass(frozen=True, slots=True)
class GemvTiles:
    """block_n outputs x block_k inputs a step; dot: tensor cores (x padded to 16 rows)
    instead of CUDA-core sums; split_k programs share each stripe's K."""
    block_n: int
    block_k: int
    dot: bool = False
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# (rows rounded up to a power of two, N, K, SMs) -> tiles, for 16-bit weights: the best of
# benchmarks/gpu/gemv_sweep.py's candidates, pasted from its last lines, on an H100 80GB
# HBM3 (132 SMs), 2026-11-26
# (benchmarks/issue29-h100/gemv-sweep.txt): where a tile beat the rules' by 3% or more;
# GemvTiles(block_n, block_k, dot, split_k, num_warps, num_stages)
TUNED_TILES: dict[tuple[int, int, int, int], GemvTiles] = {
    (1, 3072, 3072, 132): GemvTiles(4, 512, False, 1, 8, 1),
    (2, 3072, 3072, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (4, 3072, 3072, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (8, 3072, 3072, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (16, 3072, 3072, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (1, 16384, 3072, 132): GemvTiles(8, 256, False, 1, 4, 1),
    (1, 3072, 8192, 132): GemvTiles(4, 512, False, 1, 8, 1),
    (2, 8192, 3584, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (4, 8192, 3584, 132): GemvTiles(32, 256, True, 1, 4, 3),
    (8, 8192, 3584, 132): GemvTiles(32, 256, True, 1, 4, 3),
    (16, 8192, 3584, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (1, 3584, 4096, 132): GemvTiles(4, 512, False, 1, 4, 1),
    (2, 3584, 4096, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (4, 3584, 4096, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (8, 3584, 4096, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (16, 3584, 4096, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (2, 28672, 3584, 132): GemvTiles(32, 64, True, 1, 4, 3),
    (4, 28672, 3584, 132): GemvTiles(32, 64, True, 1, 4, 3),
    (8, 28672, 3584, 132): GemvTiles(32, 64, True, 1, 4, 3),
    (16, 28672, 3584, 132): GemvTiles(32, 64, True, 1, 4, 3),
    (1, 3584, 14336, 132): GemvTiles(8, 512, False, 1, 8, 1),
    (2, 6144, 4096, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (4, 6144, 4096, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (8, 6144, 4096, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (16, 6144, 4096, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (1, 4096, 4096, 132): GemvTiles(4, 512, False, 1, 4, 1),
    (8, 4096, 4096, 132): GemvTiles(32, 256, True, 1, 4, 4),
    (16, 4096, 4096, 132): GemvTiles(64, 256, True, 1, 4, 4),
    (1, 28672, 4096, 132): GemvTiles(4, 512, False, 1, 4, 1),
    (2, 28672, 4096, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (4, 28672, 4096, 132): GemvTiles(32, 128, True, 1, 4, 3),
    (8, 28672, 4096, 132): GemvTiles(64, 256, True, 1, 4, 3),
    (16, 28672, 4096, 132): GemvTiles(32, 128, True, 1, 4, 3),
    (1, 4096, 14336, 132): GemvTiles(8, 512, False, 1, 8, 1),
    (1, 5120, 2048, 132): GemvTiles(8, 512, False, 1, 4, 1),
    (2, 5120, 2048, 132): GemvTiles(64, 256, True, 1, 4, 4),
    (4, 5120, 2048, 132): GemvTiles(64, 256, True, 1, 4, 4),
    (8, 5120, 2048, 132): GemvTiles(64, 256, True, 1, 4, 4),
    (16, 5120, 2048, 132): GemvTiles(64, 256, True, 1, 4, 4),
    (1, 2048, 4096, 132): GemvTiles(4, 512, False, 1, 8, 1),
    # Qwen3-0.6B's o_proj and down_proj on an H200 (132 SMs too), 2026-11-30: 4-wide
    # stripes of 1 KiB tiles fill the SMs unsplit, 3.10 and 4.05 us a launch in a CUDA
    # graph, against the rules' K split in two and its sum, 4.23 and 5.20
    # (benchmarks/issue31-h200/split9/probe.txt)
    (1, 1024, 2048, 132): GemvTiles(4, 512, False, 1, 4, 3),
    (1, 1024, 3072, 132): GemvTiles(4, 512, False, 1, 4, 3),
    # MoE routers (Qwen3-30B-A3B's 128 experts, Mixtral's 8): no K split, whose second
    # launch outweighs the idle SMs (benchmarks/gpu/router_gemv.py, 2026-11-26:
    # 2.2 and 2.8 us against cuBLAS's 4.7 and 5.2; benchmarks/issue29-h100/router-gemv.txt)
    (1, 128, 2048, 132): GemvTiles(4, 512, False, 1, 4, 1),
    (1, 8, 4096, 132): GemvTiles(2, 512, False, 1, 4, 1),
}


# --- torch reference twin ------------------------------------------------------------------

def gemv_ref(x: torch.Tensor | SeamNorm, w: torch.Tensor, bias: torch.Tensor | None = None,
             add_to: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """One float32 matmul (+ bias), the result in x's dtype; a SeamNorm normed before and
    a residual (add_to) added after, as the unfused ops do (kernels/norm_seam.py)."""
    x = seam_input_ref(x)
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if add_to is None else residual_sum_ref(y, add_to)


# --- dispatch ------------------------------------------------------------------------------

def gemv(x: torch.Tensor | SeamNorm, w: torch.Tensor, bias: torch.Tensor | None = None,
         add_to: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """x [..., K] (at most GEMV_MAX_ROWS rows) -> [..., N]; with a norm seam (one row: a
    SeamNorm for x, or a residual to add to), what kernels/norm_seam.py says. The one
    dispatch point: CUDA tensors take the Triton kernel, others the twin."""
    if seam_tensor(x).is_cuda:
        return gemv_triton(x, w, bias, add_to=add_to)
    return gemv_ref(x, w, bias, add_to)


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pick as for an H100
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_tiles(rows: int, n: int, k: int, sms: int, element_size: int = 2,
                  scale_block_k: int | None = None) -> GemvTiles:
    """From the H100 sweep of the fp8 kernel at the 8B projections
    (benchmarks/issue30-h100/fp8-gemv-sweep.txt), with K tiles of the same bytes for wider
    weights. One row: CUDA-core sums over 8 x 512-byte tiles, about five programs an SM;
    the widest projections (gate_up, N = 28672) are 8% faster on tensor cores at 32 x 128
    bytes, 3 stages. More rows: tensor cores at 32 x 256 bytes, 4 stages; the default
    16-wide stripes ran 1.5x slower. K tiles narrowed to a K-blocked scale (128) widen the
    stripe to keep the bytes. K splits while the stripes leave SMs idle (one row), or
    number fewer than two an SM (more rows: qkv and o at 8 rows ran 30% faster split in
    two)."""
    if rows == 1 and n >= 16384:
        block_n, block_bytes, dot, warps, stages = 32, 128, True, 4, 3
    elif rows == 1:
        block_n, block_bytes, dot, warps, stages = 8, 512, False, 4, 1
    else:
        block_n, block_bytes, dot, warps, stages = 32, 256, True, 4, 4
    block_k = block_bytes // element_size
    if scale_block_k is not None and scale_block_k < min(k, block_k):
        block_n, block_k = block_n * block_k // scale_block_k, scale_block_k
    split, stripes = 1, triton.cdiv(n, block_n)
    if rows > 1:
        split = 2 if stripes < 2 * sms and k >= 8 * block_k else 1
    while stripes * split < sms and k // (2 * split) >= 4 * block_k:
        split *= 2
    return GemvTiles(block_n, block_k, dot, split, warps, stages)


def tiles_for(rows: int, n: int, k: int, sms: int) -> GemvTiles:
    """16-bit weights: the swept tiles of this shape, else the rules'."""
    tuned = TUNED_TILES.get((triton.next_power_of_2(rows), n, k, sms))
    return tuned or default_tiles(rows, n, k, sms)


def gemv_triton(x: torch.Tensor | SeamNorm, w: torch.Tensor, bias: torch.Tensor | None = None,
                tiles: GemvTiles | None = None, add_to: torch.Tensor | None = None
                ) -> torch.Tensor | ResidualSum:
    """tiles: force these tiles (the sweep); default: tiles_for the shape."""
    n, k = w.shape
    rows = seam_tensor(x)
    assert w.dtype == rows.dtype, f"gemv: {w.dtype} weights for {rows.dtype} activations"
    tiles = tiles or tiles_for(max(1, rows.numel() // k), n, k, sm_count(rows.device))
    return launch_gemv(x, w, bias, tiles, add_to=add_to)


def launch_gemv(x: torch.Tensor | SeamNorm, w: torch.Tensor, bias: torch.Tensor | None,
                tiles: GemvTiles, scale: torch.Tensor | None = None,
                scale_block: tuple[int, int] | None = None,
                add_to: torch.Tensor | None = None) -> torch.Tensor | ResidualSum:
    """The kernel (and the K split's sum) for x [..., K] and w [N, K]; scale: float32
    blocks [ceil(N / block_n), ceil(K / block_k)] of scale_block (block_n, block_k). One
    row may take a norm seam (gemv's doc): the split's sum adds the residual where K
    splits."""
    norm = x if isinstance(x, SeamNorm) else None
    x = seam_tensor(x)
    n, k = w.shape
    assert w.stride(1) == 1, "row-major weights"
    assert x.shape[-1] == k and x.dtype in (torch.bfloat16, torch.float16)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert m <= GEMV_MAX_ROWS, f"the GEMV takes at most {GEMV_MAX_ROWS} rows, not {m}"
    assert m == 1 or (norm is None and add_to is None), "a norm seam is one row"
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_n, block_k = scale_block or (n, k)
    tile_k, per_k = tiles.block_k, scale is not None and block_k < k
    if per_k:
        # a K tile inside one scale block: the largest power of two dividing block_k
        tile_k = min(tile_k, block_k & -block_k)
        assert tile_k >= 16, f"gemv: K blocks of {block_k} split into no tile of 16+"
    split = max(1, min(tiles.split_k, triton.cdiv(k, tile_k)))
    k_share = triton.cdiv(triton.cdiv(k, split), tile_k) * tile_k
    split = triton.cdiv(k, k_share)
    stripes = triton.cdiv(n, tiles.block_n)
    result = None if add_to is None else new_residual_sum(
        add_to.reshape(m, n), stripes if split == 1 else triton.cdiv(n, SUM_BLOCK))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if result is None else result.total
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    assert tiles.dot or m == 1, "more than one row takes tensor cores (tiles.dot)"
    block_m = max(triton.next_power_of_2(m), DOT_MIN_ROWS) if tiles.dot else 1
    seam, block_p = seam_arguments(norm, add_to, result, y)
    _gemv_kernel[(stripes, split)](
        x2, w, scale if scale is not None else w, bias if bias is not None else y, out, m, n,
        k, x2.stride(0), w.stride(0), scale.shape[1] if scale is not None else 0, block_n,
        block_k, k_share, *seam, HAS_SCALE=scale is not None, PER_K_SCALE=per_k,
        HAS_BIAS=bias is not None and split == 1, USE_DOT=tiles.dot, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tile_k, NORM_IN=norm is not None,
        ADD_RESIDUAL=result is not None and split == 1, BLOCK_P=block_p,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_launch(x))
    if split > 1:
        sum_splits(out, bias, y, add_to, result)
    return result if result is not None else y.reshape(*x.shape[:-1], n)


def sum_splits(parts: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
               add_to: torch.Tensor | None = None, result: ResidualSum | None = None) -> None:
    """y [m, n] = the K shares' float32 partial sums parts [splits, m, n] (+ bias), added
    up in one launch; with add_to (one row), y is result's total, the sum plus add_to,
    and each program's squares go to result's sumsq (kernels/norm_seam.py)."""
    splits, m, n = parts.shape
    _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
        parts, bias if bias is not None else y, y, m * n, n, splits,
        add_to if add_to is not None else y, result.sumsq if result is not None else y,
        HAS_BIAS=bias is not None, ADD_RESIDUAL=add_to is not None, BLOCK=SUM_BLOCK,
        **pdl_launch(y))


# --- kernels -------------------------------------------------------------------------------

@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, m, n, k, stride_x,
                 stride_w, scale_stride, scale_block_n, scale_block_k, k_share,
                 res_ptr, sumsq_ptr, norm_w_ptr, parts, eps,
                 HAS_SCALE: tl.constexpr, PER_K_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 USE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NORM_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                 BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """A BLOCK_N stripe of y's columns over one K share (program_id 1); with more than one
    share, float32 partial sums into out [shares, m, n], else y itself. Without HAS_SCALE
    the scale arguments are not read. One row only (kernels/norm_seam.py): NORM_IN, x is a
    residual sum to norm (its squares' `parts` sums at sumsq_ptr, the norm's weight at
    norm_w_ptr); ADD_RESIDUAL (one share), out takes y + residual and sumsq_ptr each
    stripe's squares."""
    let_next_start(PDL)
    stripe, share = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = stripe * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < m, offs_n < n
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + offs_m[:, None] * stride_x
    scale_rows = scale_ptr + (offs_n // scale_block_n) * scale_stride
    k_lo = share * k_share
    k_hi = tl.minimum(k_lo + k_share, k)
    # constants, loaded before waiting on the previous kernel: no round trip after the loop
    if HAS_SCALE and not PER_K_SCALE:
        scale = tl.load(scale_rows, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if USE_DOT:
        wait_for_previous(PDL)
        residual = tl.load(res_ptr + offs_n, mask=n_ok, other=0.0) if ADD_RESIDUAL else 0.0
        inv_rms = seam_inv_rms(sumsq_ptr, parts, k, eps, BLOCK_P) if NORM_IN else 1.0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = k0 + offs_k < k_hi
            w = tl.load(w_rows + k0 + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)
            xs = tl.load(x_rows + k0 + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                         other=0.0)
            if NORM_IN:  # one row: padding rows are zeros, and weighted stay zeros
                xs = seam_weigh(xs, tl.load(norm_w_ptr + k0 + offs_k, mask=k_ok,
                                            other=0.0)[None, :], inv_rms)
            # 16-bit weights are x's dtype; fp8 values are exact in it: exact products,
            # float32 sums
            part = tl.dot(xs, tl.trans(w.to(xs.dtype)))
            if PER_K_SCALE:
                part *= tl.load(scale_rows + k0 // scale_block_k, mask=n_ok,
                                other=0.0)[None, :]
            acc += part
    else:
        sums, residual = _one_row_sums(
            w_rows, x_ptr, scale_rows, n_ok, k_lo, k_hi, scale_block_k, res_ptr + offs_n,
            sumsq_ptr, norm_w_ptr, parts, k, eps, PER_K_SCALE, NORM_IN, ADD_RESIDUAL,
            BLOCK_N, BLOCK_K, BLOCK_P, PDL)
        acc = sums[None, :]
    if HAS_SCALE and not PER_K_SCALE:
        acc *= scale
    if HAS_BIAS:
        acc += bias
    if ADD_RESIDUAL:  # one row: the padding rows hold the bias alone
        seam_add(tl.sum(tl.where(m_ok[:, None], acc, 0.0), axis=0), residual, out_ptr, offs_n,
                 n_ok, sumsq_ptr + stripe)
        return
    at = (share * m + offs_m)[:, None] * n + offs_n[None, :]
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _one_row_sums(w_rows, x_ptr, scale_rows, n_ok, k_lo, k_hi, scale_block_k, res_rows,
                  sumsq_ptr, norm_w_ptr, parts, k, eps, PER_K_SCALE: tl.constexpr,
                  NORM_IN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """x's first row times the stripe over [k_lo, k_hi), scaled per K tile or not at all;
    and the stripe's residual where ADD_RESIDUAL (loaded with x's first tile, not after the
    loop). Products are summed per lane in the weight tile's own layout, with one
    cross-lane reduction after the loop (a 3-d broadcast against x's rows made the compiler
    shuffle every tile through shared memory). Each step issues the next tile's loads
    before its own arithmetic: Triton pipelines only loads that feed tl.dot, and the loads
    in flight set the bandwidth. The first weight tile is loaded before waiting on the
    previous kernel (weights are constants; x is that kernel's output). NORM_IN: x's tiles
    are normed as they come (kernels/norm_seam.py)."""
    offs_k = tl.arange(0, BLOCK_K)
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_ok = k_lo + offs_k < k_hi
    w = tl.load(w_rows + k_lo + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM_IN:
        norm_w = tl.load(norm_w_ptr + k_lo + offs_k, mask=k_ok, other=0.0)
    wait_for_previous(PDL)
    residual = tl.load(res_rows, mask=n_ok, other=0.0) if ADD_RESIDUAL else 0.0
    xs = tl.load(x_ptr + k_lo + offs_k, mask=k_ok, other=0.0)
    inv_rms = seam_inv_rms(sumsq_ptr, parts, k, eps, BLOCK_P) if NORM_IN else 1.0
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_next = k0 + BLOCK_K + offs_k
        next_ok = k_next < k_hi
        w_next = tl.load(w_rows + k_next[None, :], mask=n_ok[:, None] & next_ok[None, :],
                         other=0.0)
        x_next = tl.load(x_ptr + k_next, mask=next_ok, other=0.0)
        if NORM_IN:
            norm_w_next = tl.load(norm_w_ptr + k_next, mask=next_ok, other=0.0)
            xs = seam_weigh(xs, norm_w, inv_rms)
            norm_w = norm_w_next
        wf = w.to(tl.float32)
        if PER_K_SCALE:
            wf *= tl.load(scale_rows + k0 // scale_block_k, mask=n_ok, other=0.0)[:, None]
        lanes += wf * xs.to(tl.float32)[None, :]
        w, xs = w_next, x_next
    return tl.sum(lanes, axis=1), residual


@triton.jit
def _sum_splits_kernel(parts_ptr, bias_ptr, y_ptr, size, n, splits, res_ptr, sumsq_ptr,
                       HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y = the K shares' float32 partial sums [splits, size] added up (+ bias); with
    ADD_RESIDUAL (one row), y + residual and its squares' sum (kernels/norm_seam.py)."""
    overlap_previous(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(parts_ptr + s * size + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % n, mask=ok, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        seam_add(acc, tl.load(res_ptr + offs, mask=ok, other=0.0), y_ptr, offs, ok,
                 sumsq_ptr + tl.program_id(0))
    else:
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)

"""INT4 weights with 16-bit activations (W4A16): y = x W^T where W is stored as 4-bit
integers, one scale and one zero point per group of `group_size` input features and output
feature: W[n, k] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n].

The one layout every kernel reads (AWQ, GPTQ and compressed-tensors checkpoints are
converted to it once, at load):

- qweight int32 [K / 8, N]: nibble j (bits 4j..4j+3) of word [r, n] is q[8r + j, n], 0..15.
  Packed along the input features as GPTQ does: one word is eight rows of one output
  column, and neighbouring output columns are neighbouring words, so a program walking K
  for a stripe of N reads whole contiguous rows (AWQ packs along N with its nibbles
  interleaved; compressed-tensors packs along K but output-major).
- scales [K / g, N] in the activation dtype.
- zeros uint8 [K / g, N], unpacked: GPTQ's v1 convention stores zero - 1, so its zeros run
  1..16 and 16 does not fit a nibble; a byte costs 1/(g/2) of the weight bytes (1/64 at
  g = 128). Symmetric schemes store 8.
- perm [K] int32 or None: GPTQ's act-order (and compressed-tensors' actorder "group")
  quantizes the input features in another order, so a group's features are scattered.
  The converters sort the features by group once (qweight's rows permuted), making the
  groups contiguous again; the kernels then read x's columns through perm
  (y = x[:, perm] @ W_sorted), a gather inside the load rather than another launch.

Dequantization is exact: (q - z) is a small integer and one product with the scale is
rounded once to the activation dtype, as the reference twin does.

Two kernels: a GEMV for a few rows (decode, M <= GEMV_MAX_ROWS) where the weight read is
everything, one program per (row, N stripe) accumulating without tl.dot; and a tiled GEMM
with tl.dot for prefill and large batches. The GEMV's tiles come from a sweep on the H100
(benchmarks/gpu/int4_gemv_sweep.py): 570 to 770 GB/s of packed weights, under cuBLAS's
bf16 GEMV in time except for the widest projection; the GEMM's are first guesses. The choice between them reads only x's shape, so a
step replays in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PACK_FACTOR = 8  # int4 values per int32
GEMV_MAX_ROWS = 16


@dataclass(frozen=True, slots=True)
class Int4Tiles:
    """Tile sizes: block_m rows (GEMM only), block_n output and block_k input features."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


GEMV_TILES = Int4Tiles(1, 16, 512, num_warps=4, num_stages=2)  # the sweep's best overall
GEMM_TILES = Int4Tiles(64, 128, 64, num_warps=4, num_stages=3)


# --- packing helpers (the canonical layout) ------------------------------------------------

def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [R, N] packed along rows -> uint8 [8R, N]: row 8r + j is nibble j of row r."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    nibbles = (qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF
    return nibbles.reshape(-1, qweight.shape[1]).to(torch.uint8)


def pack_int4_rows(values: torch.Tensor) -> torch.Tensor:
    """uint8 or int [8R, N] of 0..15 -> int32 [R, N], the inverse of unpack_int4_rows."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).reshape(rows // PACK_FACTOR, PACK_FACTOR, cols)
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int64)
    words = (grouped << shifts[None, :, None]).sum(dim=1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


# --- torch reference twin ------------------------------------------------------------------

def dequantize_int4_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int) -> torch.Tensor:
    """The canonical layout -> W^T [K, N] in the scales' dtype, rows in qweight's order."""
    q = unpack_int4_rows(qweight).to(torch.int32)
    z = zeros.to(torch.int32).repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).to(scales.dtype)


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then one float32 matmul; the result in x's dtype."""
    w = dequantize_int4_ref(qweight, scales, zeros, group_size).to(x.dtype)
    if perm is not None:
        x = x[..., perm.long()]
    y = x.float() @ w.float()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


# --- dispatch ------------------------------------------------------------------------------

def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]. The one dispatch point for this op: CUDA tensors take the
    Triton kernels (GEMV up to GEMV_MAX_ROWS rows, else the tiled GEMM), others the twin."""
    if x.is_cuda:
        return w4a16_gemm_triton(x, qweight, scales, zeros, group_size, perm, bias)
    return w4a16_gemm_ref(x, qweight, scales, zeros, group_size, perm, bias)


def w4a16_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, group_size: int, perm: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None,
                      tiles: Int4Tiles | None = None) -> torch.Tensor:
    """tiles: forces the GEMM path with these tiles (block_m 1: the GEMV path); default:
    chosen by the row count."""
    k, n = qweight.shape[0] * PACK_FACTOR, qweight.shape[1]
    assert x.shape[-1] == k and qweight.is_contiguous() and scales.is_contiguous()
    # the GEMV reads a word's eight rows as one group's
    assert zeros.is_contiguous() and k % group_size == 0 and group_size % 8 == 0
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    tiles = tiles or (GEMV_TILES if m <= GEMV_MAX_ROWS else GEMM_TILES)
    args = (x2, qweight, scales, zeros, perm if perm is not None else x2,
            bias if bias is not None else x2, y, m, n, k, group_size)
    flags = dict(HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
                 BLOCK_N=tiles.block_n, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages)
    if tiles.block_m == 1:
        _w4a16_gemv_kernel[(triton.cdiv(n, tiles.block_n), m)](*args, BLOCK_K=tiles.block_k,
                                                                **flags)
    else:
        grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
        _w4a16_gemm_kernel[grid](*args, BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k,
                                 **flags)
    return y.reshape(*x.shape[:-1], n)


# --- kernels -------------------------------------------------------------------------------

@triton.jit
def _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, offs_k, offs_n, n, k,
                      group_size):
    """W^T[offs_k, offs_n] as float32: each word is loaded for its eight rows (the repeats
    hit the cache) and shifted to its nibble; scale and zero by each row's group."""
    mask = (offs_k[:, None] < k) & (offs_n[None, :] < n)
    words = tl.load(qweight_ptr + (offs_k[:, None] // 8) * n + offs_n[None, :], mask=mask,
                    other=0)
    q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
    at_group = (offs_k[:, None] // group_size) * n + offs_n[None, :]
    z = tl.load(zeros_ptr + at_group, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + at_group, mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _x_columns(perm_ptr, offs_k, k, HAS_PERM: tl.constexpr):
    """Which columns of x line up with the weight rows offs_k."""
    if HAS_PERM:
        return tl.load(perm_ptr + offs_k, mask=offs_k < k, other=0)
    return offs_k


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, y_ptr,
                       m, n, k, group_size, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of x times a BLOCK_N stripe of W^T, BLOCK_K input features a step: each
    packed word is read once as a [BLOCK_K / 8, BLOCK_N] tile and shifted into its eight
    nibbles (a word's eight rows share a group: groups are multiples of 8 rows), and the
    products go into a BLOCK_N float32 accumulator. (Taking the scale and zero out of the
    sum over a word's rows, with nibbles turned to floats by a bit trick, ran 3 to 5 times
    slower on the H100: benchmarks/issue30-h100/int4-gemv-sweep*.txt.)"""
    block, row = tl.program_id(0), tl.program_id(1)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    word_rows = tl.arange(0, BLOCK_K // 8)
    nibbles = tl.arange(0, 8)
    x_row = x_ptr + row.to(tl.int64) * k
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        rows_ok = start // 8 + word_rows < k // 8
        words = tl.load(qweight_ptr + (start // 8 + word_rows)[:, None] * n + offs_n[None, :],
                        mask=rows_ok[:, None] & n_ok[None, :], other=0)
        q = (words[:, None, :] >> (nibbles * 4)[None, :, None]) & 0xF
        at_group = ((start + word_rows * 8) // group_size)[:, None] * n + offs_n[None, :]
        z = tl.load(zeros_ptr + at_group, mask=rows_ok[:, None] & n_ok[None, :],
                    other=0).to(tl.int32)
        s = tl.load(scales_ptr + at_group, mask=rows_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)
        # rounded to the activation dtype as the twin's dequantized weight is
        w = ((q - z[:, None, :]).to(tl.float32) * s[:, None, :]).to(dtype)
        offs_k = start + word_rows[:, None] * 8 + nibbles[None, :]
        xs = tl.load(x_row + _x_columns(perm_ptr, offs_k, k, HAS_PERM), mask=offs_k < k,
                     other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(w.to(tl.float32) * xs[:, :, None], axis=0), axis=0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * n + offs_n, acc.to(dtype), mask=n_ok)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, y_ptr,
                       m, n, k, group_size, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A BLOCK_M x BLOCK_N tile of y: each K step dequantizes a [BLOCK_K, BLOCK_N] weight
    tile to the activation dtype and feeds tl.dot with float32 accumulation."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = x_ptr + offs_m.to(tl.int64)[:, None] * k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        cols = _x_columns(perm_ptr, offs_k, k, HAS_PERM)
        xs = tl.load(rows + cols[None, :], mask=(offs_m[:, None] < m) & (offs_k[None, :] < k),
                     other=0.0)
        w = _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, offs_k, offs_n, n, k,
                              group_size)
        acc = tl.dot(xs, w.to(xs.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * n + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < m) & (offs_n[None, :] < n))

"""INT4 weights with 16-bit activations (W4A16): y = x W^T where W [N, K] is stored as 4-bit
integers, one scale and one zero point per output feature and group of `group_size` input
features: W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g].

The one layout every kernel reads (AWQ, GPTQ and compressed-tensors checkpoints are
converted to it once, at load):

- qweight int32 [N, K / 8]: nibble j (bits 4j..4j+3) of word [n, r] is q[n, 8r + j], 0..15.
  Packed along the input features and output-major, as compressed-tensors stores it: a
  program owning a stripe of outputs reads each row's words contiguously, as the 16-bit
  and fp8 GEMVs read their rows, and a word's eight values meet eight neighbouring
  activations (AWQ packs along N with its nibbles interleaved; GPTQ along K but
  input-major).
- scales [N, K / g] in the activation dtype.
- zeros uint8 [N, K / g], unpacked: GPTQ's v1 convention stores zero - 1, so its zeros run
  1..16 and 16 does not fit a nibble; a byte costs 1/(g/2) of the weight bytes (1/64 at
  g = 128). Or None: symmetric, every zero SYMMETRIC_ZERO (GPTQ's sym, compressed-tensors'
  symmetric); the kernels then load no zeros and take the constant's pairs, which at one
  row saves the zeros' loads and their two moves between layouts a step.
- perm [K] int32 or None: GPTQ's act-order (and compressed-tensors' actorder "group")
  quantizes the input features in another order, so a group's features are scattered.
  The converters sort the features by group once (qweight's columns permuted), making the
  groups contiguous again; the kernels then read x's columns through perm
  (y = x[:, perm] @ W_sorted^T), a gather inside the load rather than another launch.

Two kernels. The GEMV (one row: batch-1 decode) reads every weight once and is bound by
turning nibbles into floats, not by memory (its loads alone run at 3.4-5.8 TB/s on an H200,
the whole loop at 1.4-1.9: benchmarks/gpu/int4_packed_experiment.py). On CUDA it works on
half pairs: one LOP3 ORs two nibbles of a word (bits 0-3 and 16-19, or 4-7 and 20-23)
under fp16's exponent of 1024, so the word reads as the pair (1024 + q, 1024 + q') (or
1024 + 16q: a packed multiply by 1/16 undoes it); a packed subtraction of 1024 + z leaves
q - z exactly, a packed multiply-add with two activations accumulates the word's eight
products in fp16, and only that sum is widened to float32 and times the group's scale.
The loop's SASS at gate_up's tiles runs 4.1 instructions a weight, loads and activations
included, where float32 arithmetic ran 6.5; 8B batch-1 decode went 2.90 -> 2.39 ms on an
H200 and 3.04 -> 2.63 on an H100 (benchmarks/issue30-h100/s6); 3.4 a weight and 2.24 ms
on an H200 since the group size is a constant and each pair of x one conversion (s9).
fp16 holds the products because each word's eight activations are scaled by the power of
two that puts their largest under 2^8: |q - z| <= 16, so a word's sum stays under 2^15,
and the smallest activations that matter stay normal; the sum is scaled back in float32.
The interpreter, which has no inline assembly, runs the exact float32 form: each nibble
kept in place (a 20-bit shift for the top three), ORed under the exponent of 2^23 so that
the word's bits read as the float 2^23 + q * 16^j, less 2^23 + z * 16^j (exact: (q - z) *
16^j, an integer under 2^24), times the activation times 16^-j. Its K tiles span whole
groups (up to 1024 inputs, 512 bytes of each row's words: HBM serves long runs faster than
the 64-byte pieces of one group's tile), or lie inside one, so that each group of a tile
has one scale and zero a row. The first tile's weights are loaded before the kernel waits
on the previous one (kernels/pdl.py). Either way the error stays under the twin's, which
rounds each dequantized weight to the activation dtype. Split-K partial sums are added by
kernels/gemv.py's second launch, as there, or left to the norm that takes them
(summed=False, kernels/norm.py).
The tiled GEMM (more rows: larger decode batches, prefill) dequantizes [BLOCK_N, BLOCK_K]
tiles to the activation dtype and feeds tl.dot; from DEQUANTIZE_MIN_ROWS rows (prefill) the
weight is dequantized once and cuBLAS multiplies. Tiles come from sweeps on the H100
(benchmarks/gpu/int4_gemv_sweep.py, benchmarks/issue30-h100): the GEMV reads 1.4-1.9 TB/s
of packed weights at the 8B projections. The choice reads only shapes, so a step replays in
a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv import sm_count, sum_splits
from kernels.packed_half import half_pair, power_of_two_scales
from kernels.pdl import let_next_start, overlap_previous, pdl_launch, wait_for_previous

PACK_FACTOR = 8  # int4 values per int32
SYMMETRIC_ZERO = 8  # every zero of a symmetric scheme (zeros None)
_SYMMETRIC_ZERO = tl.constexpr(SYMMETRIC_ZERO)  # the same, for the kernels
# One word's sum of (q - z) * x over its eight nibbles in packed half arithmetic (the
# module's docstring): $1 the word; $2..$5 the activation pairs (x0, x4), (x1, x5), (x2, x6),
# (x3, x7) as f16x2; $6 the pair (1024 + z, 1024 + z); $7 (-64 - z, -64 - z). 0x2C00 is
# 1/16 in fp16; LUT 0xEA is (a & b) | c.
WORD_SUM_ASM = tl.constexpr("""
{
.reg .b32 h0, h1, h2, h3, w2, acc, sixteenth;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 sixteenth, 0x2C002C00;
lop3.b32 h0, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h1, $1, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 w2, $1, 8;
lop3.b32 h2, w2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 h3, w2, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 h0, h0, $6;
fma.rn.f16x2 h1, h1, sixteenth, $7;
sub.f16x2 h2, h2, $6;
fma.rn.f16x2 h3, h3, sixteenth, $7;
mul.rn.f16x2 acc, h0, $2;
fma.rn.f16x2 acc, h1, $3, acc;
fma.rn.f16x2 acc, h2, $4, acc;
fma.rn.f16x2 acc, h3, $5, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}
""")


@dataclass(frozen=True, slots=True)
class Int4Tiles:
    """Tile sizes: block_m rows (1: the GEMV), block_n output and block_k input features;
    split_k programs share each stripe's K (0: as many as fill the SMs)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0


# one row: 16 outputs x 1024 inputs (512 bytes of each row's words a step), and where the
# H200 sweep of the packed loop found better at Llama-3.1-8B's projections, its tiles
# (benchmarks/issue30-h100/s6/int4-sweep-ab.txt; the loop is bound by instructions, and
# the H100's SMs and clocks are the H200's)
GEMV_TILES = Int4Tiles(1, 16, 1024, num_warps=4, num_stages=1)
TUNED_GEMV_TILES: dict[tuple[int, int, int], Int4Tiles] = {  # (N, K, SMs) -> tiles
    (6144, 4096, 132): Int4Tiles(1, 32, 1024, num_warps=4, num_stages=1, split_k=1),
    (4096, 4096, 132): Int4Tiles(1, 16, 1024, num_warps=4, num_stages=1, split_k=2),
    (28672, 4096, 132): Int4Tiles(1, 32, 512, num_warps=4, num_stages=1, split_k=1),
    (4096, 14336, 132): Int4Tiles(1, 16, 1024, num_warps=4, num_stages=1, split_k=2),
}
GEMM_TILES = Int4Tiles(64, 128, 64, num_warps=4, num_stages=3)
DECODE_TILES = Int4Tiles(16, 64, 128, num_warps=4, num_stages=3)  # 2..16 rows
# from this many rows the weight is dequantized to 16 bits for cuBLAS (vLLM's AWQ switch
# sits at 256 tokens too)
DEQUANTIZE_MIN_ROWS = 256
DEQUANTIZE_TILE = (64, 128)


# --- packing helpers (the canonical layout) ------------------------------------------------

def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., 8C]: value 8c + j is nibble j of word c."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(*words.shape[:-1], -1).to(torch.uint8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 or int [..., 8C] of 0..15 -> int32 [..., C], the inverse of unpack_int4."""
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK_FACTOR)
    shifts = torch.arange(0, 32, 4, device=values.device, dtype=torch.int64)
    words = (grouped << shifts).sum(dim=-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


# --- torch reference twin ------------------------------------------------------------------

def dequantize_int4_ref(qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The canonical layout -> W [N, K] in the scales' dtype, columns in qweight's order."""
    q = unpack_int4(qweight).to(torch.int32)
    if zeros is None:
        zeros = torch.full(scales.shape, SYMMETRIC_ZERO, device=scales.device)
    z = zeros.to(torch.int32).repeat_interleave(group_size, dim=1)
    s = scales.float().repeat_interleave(group_size, dim=1)
    return ((q - z).float() * s).to(scales.dtype)


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None, group_size: int,
                   perm: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then one float32 matmul; the result in x's dtype."""
    w = dequantize_int4_ref(qweight, scales, zeros, group_size).to(x.dtype)
    if perm is not None:
        x = x[..., perm.long()]
    y = x.float() @ w.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


# --- dispatch ------------------------------------------------------------------------------

def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, group_size: int, perm: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, summed: bool = True) -> torch.Tensor:
    """x [..., K] -> [..., N]. The one dispatch point for this op: CUDA tensors take the
    Triton kernels (the GEMV at one row, else the tiled GEMM), others the twin. summed
    False: where the kernels split K, the shares' float32 partial sums [..., splits, N]
    unsummed, for a norm that adds them in its load (kernels/norm.py)."""
    if x.is_cuda:
        return w4a16_gemm_triton(x, qweight, scales, zeros, group_size, perm, bias,
                                 summed=summed)
    return w4a16_gemm_ref(x, qweight, scales, zeros, group_size, perm, bias)


def default_tiles(m: int, n: int, k: int, sms: int) -> Int4Tiles:
    if m == 1:
        return TUNED_GEMV_TILES.get((n, k, sms), GEMV_TILES)
    return DECODE_TILES if m <= 16 else GEMM_TILES


def k_tile(block_k: int, group_size: int) -> int:
    """The widest K tile up to block_k inside one group: a power of two dividing it."""
    return min(block_k, group_size & -group_size)


def gemv_k_tile(block_k: int, group_size: int, k: int) -> int:
    """The GEMV's K tile: block_k, halved until it divides K, where that spans whole
    groups of a power-of-two size (a row's words read in long runs); else k_tile."""
    if block_k <= group_size or group_size & (group_size - 1):
        return k_tile(block_k, group_size)
    tile = block_k
    while k % tile:
        tile //= 2
    return tile


def split_count(tiles: Int4Tiles, stripes: int, k: int, block_k: int, sms: int) -> int:
    """tiles.split_k, or K shares doubled while there are fewer than four programs an SM
    and each share keeps four tiles (the H100 sweep's best split at each 8B projection)."""
    if tiles.split_k:
        return max(1, min(tiles.split_k, k // block_k))
    split = 1
    while stripes * split < 4 * sms and k // (2 * split) >= 4 * block_k:
        split *= 2
    return split


def w4a16_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, group_size: int,
                      perm: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None,
                      tiles: Int4Tiles | None = None, summed: bool = True) -> torch.Tensor:
    """tiles: force these tiles (block_m 1: the GEMV; the sweep and tests); default: by the
    row count. summed: as w4a16_gemm's (with a bias the parts are summed anyway)."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK_FACTOR
    assert x.shape[-1] == k and qweight.is_contiguous() and scales.is_contiguous()
    assert zeros is None or zeros.is_contiguous()
    assert k % group_size == 0 and group_size % 8 == 0
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if tiles is None and m >= DEQUANTIZE_MIN_ROWS:
        return dequantized_matmul(x2, qweight, scales, zeros, group_size, perm,
                                  bias).reshape(*x.shape[:-1], n)
    tiles = tiles or default_tiles(m, n, k, sm_count(x.device))
    gemv = tiles.block_m == 1
    block_k = (gemv_k_tile(tiles.block_k, group_size, k) if gemv
               else k_tile(tiles.block_k, group_size))
    stripes = triton.cdiv(n, tiles.block_n)
    rows = triton.cdiv(m, tiles.block_m)
    split = split_count(tiles, stripes * rows, k, block_k, sm_count(x.device))
    k_share = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_share)
    parts = split > 1 and not summed and bias is None  # the shares' sums left to a norm
    y = None if parts else torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    args = (x2, qweight, scales, zeros if zeros is not None else qweight,
            perm if perm is not None else x2, bias if bias is not None else x2, out, m, n, k,
            group_size, k_share)
    flags = dict(HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None,
                 HAS_BIAS=bias is not None and split == 1,
                 BLOCK_N=tiles.block_n, BLOCK_K=block_k, num_warps=tiles.num_warps,
                 num_stages=tiles.num_stages, **pdl_launch(x))
    if gemv:
        _w4a16_gemv_kernel[(stripes, split, m)](*args, GROUPS=max(1, block_k // group_size),
                                                PACKED=x.is_cuda, **flags)
    else:
        _w4a16_gemm_kernel[(rows, stripes, split)](*args, BLOCK_M=tiles.block_m, **flags)
    if parts:
        return out.permute(1, 0, 2).unflatten(0, x.shape[:-1])
    assert y is not None
    if split > 1:
        sum_splits(out, bias, y)
    return y.reshape(*x.shape[:-1], n)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The canonical layout -> W [N, K] in the scales' dtype (dequantize_int4_ref's twin)."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK_FACTOR
    w = torch.empty(n, k, dtype=scales.dtype, device=qweight.device)
    block_n, block_k = DEQUANTIZE_TILE[0], k_tile(DEQUANTIZE_TILE[1], group_size)
    _dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](
        qweight, scales, zeros if zeros is not None else qweight, w, n, k, group_size,
        HAS_ZEROS=zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k, **pdl_launch(qweight))
    return w


def dequantized_matmul(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor | None, group_size: int, perm: torch.Tensor | None,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows (prefill): the weight dequantized once to x's dtype, then cuBLAS; its
    16-bit copy is read once per tile of rows where the fused GEMM dequantizes every tile
    again (four times slower at 2048 rows on the H100, benchmarks/issue30-h100)."""
    w = dequantize_int4(qweight, scales.to(x2.dtype), zeros, group_size)
    if perm is not None:
        x2 = x2[:, perm.long()]
    if bias is None:
        return x2 @ w.T
    return torch.addmm(bias, x2, w.T)


# --- kernels -------------------------------------------------------------------------------

@triton.jit
def _zeros(ptrs, mask, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """The zeros at ptrs ([BLOCK_N, GROUPS], or [BLOCK_N] where GROUPS is 0), or, without
    them, SYMMETRIC_ZERO everywhere: a constant, so the pairs made of it are constants too
    and nothing is loaded or moved between layouts."""
    if HAS_ZEROS:
        zeros = tl.load(ptrs, mask=mask, other=0)
    elif GROUPS == 0:
        zeros = tl.full((BLOCK_N,), _SYMMETRIC_ZERO, tl.uint8)
    else:
        zeros = tl.full((BLOCK_N, GROUPS), _SYMMETRIC_ZERO, tl.uint8)
    return zeros


@triton.jit
def _x_columns(perm_ptr, offs_k, HAS_PERM: tl.constexpr):
    """Which columns of x line up with the (sorted) weight columns offs_k."""
    if HAS_PERM:
        return tl.load(perm_ptr + offs_k)
    return offs_k


@triton.jit
def _x_tile(x_row, perm_ptr, k0, x_at, HAS_PERM: tl.constexpr):
    """x's columns lined up with weight columns k0 + x_at ([BLOCK_K / 8, 8]: a word's
    eight), through perm under act-order, in float32."""
    if HAS_PERM:
        return tl.load(x_row + tl.load(perm_ptr + k0 + x_at)).to(tl.float32)
    return tl.load(x_row + k0 + x_at).to(tl.float32)


@triton.jit
def _nibble_sums(words, x8, zero, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUPS: tl.constexpr):
    """sum over each word's eight nibbles j of (q_j - zero) * x8[word column, j], in
    float32, as [BLOCK_N, GROUPS, words a group] (words [BLOCK_N, BLOCK_K / 8] over GROUPS
    whole groups, or inside one; x8 [BLOCK_K / 8, 8]; zero [BLOCK_N, GROUPS]). x8 comes
    apart into its eight columns by halving splits (a few 16-byte loads where eight
    strided ones ran 10-15% slower), and each nibble is read in place (the module's
    docstring)."""
    per_group: tl.constexpr = BLOCK_K // 8 // GROUPS
    words = tl.reshape(words, (BLOCK_N, GROUPS, per_group))
    zero = zero.to(tl.float32)[:, :, None]
    low, high = words, words >> 20  # nibbles 5..7 at bits 0..11 of high
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight_columns(
        tl.reshape(x8, (GROUPS, per_group, 2, 2, 2)))
    acc = _nibble_products(low, 0, x0, zero)
    acc += _nibble_products(low, 1, x1, zero)
    acc += _nibble_products(low, 2, x2, zero)
    acc += _nibble_products(low, 3, x3, zero)
    acc += _nibble_products(low, 4, x4, zero)
    acc += _nibble_products(high, 0, x5, zero)
    acc += _nibble_products(high, 1, x6, zero)
    acc += _nibble_products(high, 2, x7, zero)
    return acc


@triton.jit
def _eight_columns(x):
    """x [..., 2, 2, 2]: a word's eight activations, activation j = 4a + 2b + c at
    [..., a, b, c]; returned as x0 .. x7 (halving splits, the last axis first)."""
    x4a, x4b = tl.split(x)  # j even, j odd
    x2a, x2b = tl.split(x4a)
    x2c, x2d = tl.split(x4b)
    x0, x4 = tl.split(x2a)
    x2, x6 = tl.split(x2b)
    x1, x5 = tl.split(x2c)
    x3, x7 = tl.split(x2d)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _packed_nibble_sums(words, x8, zero, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUPS: tl.constexpr):
    """_nibble_sums in packed half arithmetic (CUDA only; the module's docstring). Each
    word's eight activations are multiplied by 2^(7 - e) on the way in and its sum by
    2^(e - 7) on the way out, 2^e their largest magnitude rounded down to a power of two:
    a scale a thread finds in its own registers, where one for the tile would cost a
    reduction across the program each step."""
    per_group: tl.constexpr = BLOCK_K // 8 // GROUPS
    shape: tl.constexpr = (BLOCK_N, BLOCK_K // 8)
    up, down = power_of_two_scales(tl.max(tl.abs(x8), axis=1), 7)
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight_columns(
        tl.reshape(x8 * up[:, None], (BLOCK_K // 8, 2, 2, 2)))
    zero = zero.to(tl.float32)
    sums = tl.inline_asm_elementwise(
        WORD_SUM_ASM, "=r,r,r,r,r,r,r,r",
        [words, tl.broadcast_to(half_pair(x0, x4)[None, :], shape),
         tl.broadcast_to(half_pair(x1, x5)[None, :], shape),
         tl.broadcast_to(half_pair(x2, x6)[None, :], shape),
         tl.broadcast_to(half_pair(x3, x7)[None, :], shape),
         _per_word(half_pair(1024.0 + zero, 1024.0 + zero), BLOCK_N, BLOCK_K, GROUPS),
         _per_word(half_pair(-64.0 - zero, -64.0 - zero), BLOCK_N, BLOCK_K, GROUPS)],
        dtype=tl.int32, is_pure=True, pack=1)
    return tl.reshape(sums.to(tl.float32, bitcast=True) * down[None, :],
                      (BLOCK_N, GROUPS, per_group))


@triton.jit
def _per_word(per_group, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    """[BLOCK_N, GROUPS] -> [BLOCK_N, BLOCK_K / 8]: each group's value at its words."""
    per_group_words: tl.constexpr = BLOCK_K // 8 // GROUPS
    return tl.reshape(tl.broadcast_to(per_group[:, :, None],
                                      (BLOCK_N, GROUPS, per_group_words)),
                      (BLOCK_N, BLOCK_K // 8))


@triton.jit
def _nibble_products(words, place: tl.constexpr, xs, zero):
    """(q - zero) * xs for the nibble at bits 4 * place of each word, as
    ((q - zero) * 16^place) * (xs * 16^-place): both factors exact."""
    bits = (words & (0xF << (4 * place))) | 0x4B000000
    value = bits.to(tl.float32, bitcast=True) - (8388608.0 + zero * (1 << (4 * place)))
    return value * (xs * (1.0 / (1 << (4 * place))))[None, :, :]


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr,
                       out_ptr, m, n, k, group_size: tl.constexpr, k_share,
                       HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                       PACKED: tl.constexpr, PDL: tl.constexpr):
    """One row of x (program_id 2) times a BLOCK_N stripe of W over one K share
    (program_id 1): float32 partial sums into out [shares, m, n], or y itself; PACKED: in
    packed half arithmetic (CUDA), else in float32 (the interpreter). A K tile
    spans GROUPS whole groups, or lies inside one (GROUPS 1), so that each row's words
    are read in long runs. The first tile's words, scales and zeros are loaded before
    waiting on the previous kernel (they are constants); each step then loads the next
    tile before its own arithmetic, and the sums stay per lane in the words' layout until
    one reduction after the loop. group_size is a constant of the compiled kernel: a
    step's group index is then a shift, where a runtime divisor cost an integer division
    a step, 8% of the loop's time (benchmarks/issue30-h100/s9)."""
    let_next_start(PDL)
    stripe, share, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = stripe * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    cols = tl.arange(0, BLOCK_K // 8)
    w_rows = qweight_ptr + offs_n.to(tl.int64)[:, None] * (k // 8) + cols[None, :]
    at_group = (offs_n * (k // group_size))[:, None] + tl.arange(0, GROUPS)[None, :]
    x_row = x_ptr + row.to(tl.int64) * k
    x_at = cols[:, None] * 8 + tl.arange(0, 8)[None, :]
    k_lo = share * k_share
    k_hi = tl.minimum(k_lo + k_share, k)
    lanes = tl.zeros((BLOCK_N, GROUPS, BLOCK_K // 8 // GROUPS), dtype=tl.float32)
    words = tl.load(w_rows + k_lo // 8, mask=n_ok[:, None], other=0)
    s = tl.load(scales_ptr + at_group + k_lo // group_size, mask=n_ok[:, None], other=0.0)
    z = _zeros(zeros_ptr + at_group + k_lo // group_size, n_ok[:, None], HAS_ZEROS, BLOCK_N,
               GROUPS)
    wait_for_previous(PDL)
    x8 = _x_tile(x_row, perm_ptr, k_lo, x_at, HAS_PERM)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # the next tile; past the share's end, x is read at its last tile and not used
        ahead = (offs_n < tl.where(k0 + BLOCK_K < k_hi, n, 0))[:, None]
        next_words = tl.load(w_rows + (k0 + BLOCK_K) // 8, mask=ahead, other=0)
        next_s = tl.load(scales_ptr + at_group + (k0 + BLOCK_K) // group_size, mask=ahead,
                         other=0.0)
        next_z = _zeros(zeros_ptr + at_group + (k0 + BLOCK_K) // group_size, ahead, HAS_ZEROS,
                        BLOCK_N, GROUPS)
        next_x8 = _x_tile(x_row, perm_ptr, tl.minimum(k0 + BLOCK_K, k - BLOCK_K), x_at,
                          HAS_PERM)
        if PACKED:
            sums = _packed_nibble_sums(words, x8, z, BLOCK_N, BLOCK_K, GROUPS)
        else:
            sums = _nibble_sums(words, x8, z, BLOCK_N, BLOCK_K, GROUPS)
        lanes += sums * s.to(tl.float32)[:, :, None]
        words, s, z, x8 = next_words, next_s, next_z, next_x8
    acc = tl.sum(tl.sum(lanes, axis=2), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (share * m + row).to(tl.int64) * n + offs_n,
             acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, offs_n, n_ok, k0, k, group_size,
                      HAS_ZEROS: tl.constexpr, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """W[offs_n, k0 : k0 + BLOCK_K] in dtype: the [BLOCK_N, BLOCK_K / 8] words loaded along
    their rows, shifted into their nibbles, less the row's zero, times its scale (the tile
    lies in one group)."""
    cols = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(qweight_ptr + offs_n.to(tl.int64)[:, None] * (k // 8) + cols[None, :],
                    mask=n_ok[:, None], other=0)
    q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, BLOCK_K))
    at_group = offs_n * (k // group_size) + k0 // group_size
    z = _zeros(zeros_ptr + at_group, n_ok, HAS_ZEROS, BLOCK_N, 0).to(tl.int32)
    s = tl.load(scales_ptr + at_group, mask=n_ok, other=0.0).to(tl.float32)
    return ((q - z[:, None]).to(tl.float32) * s[:, None]).to(dtype)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr,
                       m, n, k, group_size: tl.constexpr, k_share, HAS_ZEROS: tl.constexpr,
                       HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """A BLOCK_M x BLOCK_N tile of y over one K share (program_id 2): each K step
    dequantizes a weight tile to the activation dtype and feeds tl.dot with float32
    accumulation; partial sums into out [shares, m, n], or y itself."""
    overlap_previous(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    share = tl.program_id(2)
    m_ok, n_ok = offs_m < m, offs_n < n
    rows = x_ptr + offs_m.to(tl.int64)[:, None] * k
    k_lo = share * k_share
    k_hi = tl.minimum(k_lo + k_share, k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = _x_columns(perm_ptr, k0 + tl.arange(0, BLOCK_K), HAS_PERM)
        xs = tl.load(rows + cols[None, :], mask=m_ok[:, None], other=0.0)
        w = _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, offs_n, n_ok, k0, k,
                              group_size, HAS_ZEROS, xs.dtype, BLOCK_N, BLOCK_K)
        acc = tl.dot(xs, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    at = (share * m + offs_m).to(tl.int64)[:, None] * n + offs_n[None, :]
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequantize_kernel(qweight_ptr, scales_ptr, zeros_ptr, w_ptr, n, k,
                       group_size: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """W[stripe, K tile] in w's dtype."""
    overlap_previous(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequantized_tile(qweight_ptr, scales_ptr, zeros_ptr, offs_n, n_ok, k0, k, group_size,
                          HAS_ZEROS, w_ptr.dtype.element_ty, BLOCK_N, BLOCK_K)
    at = offs_n.to(tl.int64)[:, None] * k + k0 + tl.arange(0, BLOCK_K)[None, :]
    tl.store(w_ptr + at, w, mask=n_ok[:, None])

"""Where the int4 GEMV's loop spends what its weights do not need (issue 30: 8B batch-1
decode at 2.4 ms on the H100 needs the projections faster; the loop is bound by
instructions, benchmarks/issue30-h100/s6). The shipped loop's sm_90 SASS at gate_up's tiles
has about 477 instructions a step for 256 of packed arithmetic: the rest turns x into
scaled half pairs and the zeros into pairs, moves both (and the scales) between layouts
through shared memory with 16 barriers, and divides by the runtime group size.

Variants of the shipped loop, one row, each K share's float32 sums stored (no second
launch), timed in a CUDA graph at Llama-3.1-8B's projections and the shipped tiles:

- `copy`: the shipped loop as it was at a68fcab, the group size a runtime argument (the
  baseline; its pairs of x are made by today's `half_pair`).
- `group`: the group size a compile-time constant (shifts, not a division a step).
- `x`: also x's pairs computed once, from the share's first tile (wrong sums: it bounds
  what preparing x once instead of every step could save).
- `xz`: also the zeros' pairs once.
- `xzs`: also the scales once: what is left is the words' loads and the packed arithmetic.
- `read`: the words' loads only.
- `bf16`: `group` with the products in bf16x2 instead of f16x2: bf16's exponent covers any
  activation, so x is neither scaled nor converted (its bf16 pairs are permuted into
  place), at the price of a shift for each nibble pair and bf16's shorter mantissa in the
  word's four-term sums.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/int4_overhead_experiment.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from benchmarks.gpu.graph_timing import graph_us
from benchmarks.gpu.int4_packed_experiment import (GROUP, SHAPES, exact_product,
                                                   random_projection)
from kernels.int4 import (TUNED_GEMV_TILES, WORD_SUM_ASM, _eight_columns, _per_word,
                          gemv_k_tile, split_count, w4a16_gemm_ref)
from kernels.packed_half import half_pair, power_of_two_scales

MODES = ["copy", "group", "x", "xz", "xzs", "read", "bf16"]
# one word's sum of (q - z) * x in bf16x2 arithmetic: $1 the word; $2..$5 the activation
# pairs (x0, x4), (x1, x5), (x2, x6), (x3, x7) as bf16x2; $6 the pair (128 + z, 128 + z).
# 0x4300 is 128 in bf16, whose 7-bit mantissa holds a nibble exactly at that exponent.
BF16_WORD_SUM_ASM = tl.constexpr("""
{
.reg .b32 h0, h1, h2, h3, w1, w2, w3, acc, lo, hi;
.reg .f32 flo, fhi;
lop3.b32 h0, $1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w1, $1, 4;
lop3.b32 h1, w1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w2, $1, 8;
lop3.b32 h2, w2, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w3, $1, 12;
lop3.b32 h3, w3, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 h0, h0, $6;
sub.rn.bf16x2 h1, h1, $6;
sub.rn.bf16x2 h2, h2, $6;
sub.rn.bf16x2 h3, h3, $6;
mul.rn.bf16x2 acc, h0, $2;
fma.rn.bf16x2 acc, h1, $3, acc;
fma.rn.bf16x2 acc, h2, $4, acc;
fma.rn.bf16x2 acc, h3, $5, acc;
shl.b32 lo, acc, 16;
and.b32 hi, acc, 0xFFFF0000;
mov.b32 flo, lo;
mov.b32 fhi, hi;
add.f32 $0, flo, fhi;
}
""")


@triton.jit
def _x_pairs(x8, BLOCK_K: tl.constexpr):
    up, down = power_of_two_scales(tl.max(tl.abs(x8), axis=1), 7)
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight_columns(
        tl.reshape(x8 * up[:, None], (BLOCK_K // 8, 2, 2, 2)))
    return half_pair(x0, x4), half_pair(x1, x5), half_pair(x2, x6), half_pair(x3, x7), down


@triton.jit
def _bf16_pair(low, high):
    """Two bf16 tensors as one int32 of bf16x2: low in bits 0-15."""
    return ((low.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
            | (high.to(tl.int16, bitcast=True).to(tl.int32) << 16))


@triton.jit
def _bf16_sums(words, x8, z, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUPS: tl.constexpr):
    shape: tl.constexpr = (BLOCK_N, BLOCK_K // 8)
    x0, x1, x2, x3, x4, x5, x6, x7 = _eight_columns(tl.reshape(x8, (BLOCK_K // 8, 2, 2, 2)))
    zb = (128.0 + z.to(tl.float32)).to(tl.bfloat16)
    sums = tl.inline_asm_elementwise(
        BF16_WORD_SUM_ASM, "=r,r,r,r,r,r,r",
        [words, tl.broadcast_to(_bf16_pair(x0, x4)[None, :], shape),
         tl.broadcast_to(_bf16_pair(x1, x5)[None, :], shape),
         tl.broadcast_to(_bf16_pair(x2, x6)[None, :], shape),
         tl.broadcast_to(_bf16_pair(x3, x7)[None, :], shape),
         _per_word(_bf16_pair(zb, zb), BLOCK_N, BLOCK_K, GROUPS)],
        dtype=tl.int32, is_pure=True, pack=1)
    return sums.to(tl.float32, bitcast=True)


@triton.jit
def _experiment_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, n, k, group_size,
                       k_share, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUPS: tl.constexpr, GROUP_C: tl.constexpr, MODE: tl.constexpr):
    """MODE: the index of the variant in MODES. GROUP_C: the group size as a constant
    (MODE >= 1)."""
    stripe, share = tl.program_id(0), tl.program_id(1)
    if MODE >= 1:
        gs = GROUP_C
    else:
        gs = group_size
    offs_n = stripe * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    cols = tl.arange(0, BLOCK_K // 8)
    per_group: tl.constexpr = BLOCK_K // 8 // GROUPS
    shape: tl.constexpr = (BLOCK_N, BLOCK_K // 8)
    w_rows = qweight_ptr + offs_n.to(tl.int64)[:, None] * (k // 8) + cols[None, :]
    at_group = (offs_n * (k // gs))[:, None] + tl.arange(0, GROUPS)[None, :]
    x_at = cols[:, None] * 8 + tl.arange(0, 8)[None, :]
    k_lo = share * k_share
    k_hi = tl.minimum(k_lo + k_share, k)
    lanes = tl.zeros((BLOCK_N, GROUPS, per_group), dtype=tl.float32)
    bits = tl.zeros(shape, dtype=tl.int32)
    words = tl.load(w_rows + k_lo // 8, mask=n_ok[:, None], other=0)
    s = tl.load(scales_ptr + at_group + k_lo // gs, mask=n_ok[:, None], other=0.0)
    z = tl.load(zeros_ptr + at_group + k_lo // gs, mask=n_ok[:, None], other=0)
    x8b = tl.load(x_ptr + k_lo + x_at)
    x8 = x8b.to(tl.float32)
    p0, p1, p2, p3, down = _x_pairs(x8, BLOCK_K)
    zf = z.to(tl.float32)
    z1 = _per_word(half_pair(1024.0 + zf, 1024.0 + zf), BLOCK_N, BLOCK_K, GROUPS)
    z2 = _per_word(half_pair(-64.0 - zf, -64.0 - zf), BLOCK_N, BLOCK_K, GROUPS)
    s32 = s.to(tl.float32)[:, :, None]
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ahead = (offs_n < tl.where(k0 + BLOCK_K < k_hi, n, 0))[:, None]
        next_words = tl.load(w_rows + (k0 + BLOCK_K) // 8, mask=ahead, other=0)
        if MODE == 5:
            bits ^= words
        elif MODE == 6:
            sums = _bf16_sums(words, x8b, z, BLOCK_N, BLOCK_K, GROUPS)
            x8b = tl.load(x_ptr + tl.minimum(k0 + BLOCK_K, k - BLOCK_K) + x_at)
            z = tl.load(zeros_ptr + at_group + (k0 + BLOCK_K) // gs, mask=ahead, other=0)
            s32 = s.to(tl.float32)[:, :, None]
            s = tl.load(scales_ptr + at_group + (k0 + BLOCK_K) // gs, mask=ahead, other=0.0)
            lanes += tl.reshape(sums, (BLOCK_N, GROUPS, per_group)) * s32
        else:
            if MODE <= 1:
                p0, p1, p2, p3, down = _x_pairs(x8, BLOCK_K)
                x8 = tl.load(x_ptr + tl.minimum(k0 + BLOCK_K, k - BLOCK_K) + x_at).to(
                    tl.float32)
            if MODE <= 2:
                zf = z.to(tl.float32)
                z1 = _per_word(half_pair(1024.0 + zf, 1024.0 + zf), BLOCK_N, BLOCK_K, GROUPS)
                z2 = _per_word(half_pair(-64.0 - zf, -64.0 - zf), BLOCK_N, BLOCK_K, GROUPS)
                z = tl.load(zeros_ptr + at_group + (k0 + BLOCK_K) // gs, mask=ahead, other=0)
            if MODE <= 3:
                s32 = s.to(tl.float32)[:, :, None]
                s = tl.load(scales_ptr + at_group + (k0 + BLOCK_K) // gs, mask=ahead,
                            other=0.0)
            sums = tl.inline_asm_elementwise(
                WORD_SUM_ASM, "=r,r,r,r,r,r,r,r",
                [words, tl.broadcast_to(p0[None, :], shape),
                 tl.broadcast_to(p1[None, :], shape), tl.broadcast_to(p2[None, :], shape),
                 tl.broadcast_to(p3[None, :], shape), z1, z2],
                dtype=tl.int32, is_pure=True, pack=1)
            sums = tl.reshape(sums.to(tl.float32, bitcast=True) * down[None, :],
                              (BLOCK_N, GROUPS, per_group))
            lanes += sums * s32
        words = next_words
    if MODE == 5:
        acc = tl.sum(bits, axis=1).to(tl.float32)
    else:
        acc = tl.sum(tl.sum(lanes, axis=2), axis=1)
    tl.store(out_ptr + share * n + offs_n, acc, mask=n_ok)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got - exact).norm() / exact.norm()).item()


def run(mode: int, x, qweight, scales, zeros, out):
    n, k = qweight.shape[0], qweight.shape[1] * 8
    tiles = TUNED_GEMV_TILES[(n, k, 132)]
    block_k = gemv_k_tile(tiles.block_k, GROUP, k)
    stripes = triton.cdiv(n, tiles.block_n)
    split = split_count(tiles, stripes, k, block_k, 132)
    k_share = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    _experiment_kernel[(stripes, triton.cdiv(k, k_share))](
        x, qweight, scales, zeros, out, n, k, GROUP, k_share, BLOCK_N=tiles.block_n,
        BLOCK_K=block_k, GROUPS=max(1, block_k // GROUP), GROUP_C=GROUP, MODE=mode,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), triton.__version__)
    print("shape      " + "".join(f"{m:>14s}" for m in MODES))
    total = {m: 0.0 for m in MODES}
    for name, (k, n) in SHAPES.items():
        x, qweight, scales, zeros, nbytes = random_projection(k, n)
        out = torch.empty(2, n, device="cuda")
        exact = exact_product(x, qweight, scales, zeros).flatten()
        twin = w4a16_gemm_ref(x, qweight, scales, zeros, GROUP).double().flatten()
        errors = [f"twin {relative_error(twin, exact):.2e}"]
        for mode in (MODES.index("group"), MODES.index("bf16")):
            out.zero_()
            run(mode, x, qweight, scales, zeros, out)
            errors.append(f"{MODES[mode]} {relative_error(out.double().sum(0), exact):.2e}")
        cells = []
        for mode, label in enumerate(MODES):
            us = graph_us(lambda: run(mode, x, qweight, scales, zeros, out), calls=50)
            total[label] += us
            cells.append(f"{us:6.1f}us {nbytes / us / 1e6:4.2f}T")
        print(f"{name:10s} " + "".join(f"{c:>14s}" for c in cells) + "  error: "
              + ", ".join(errors), flush=True)
    print("a layer    " + "".join(f"{total[m]:12.1f}us" for m in MODES))


if __name__ == "__main__":
    main()

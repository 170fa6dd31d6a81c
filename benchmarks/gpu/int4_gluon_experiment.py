"""An int4 GEMV whose layouts are chosen, not inferred (Gluon): issue 30's 8B batch-1 decode
needs the one-row int4 GEMV faster, and the shipped Triton loop moves x's pairs, its
scales and the zeros' pairs between layouts through shared memory every step, 16 barriers
a step at gate_up's tiles (benchmarks/issue30-h100/s9). Here each thread holds VEC
neighbouring words of BLOCK_N / WARPS rows, loads the activations of its own words
(replicated across the warps, from L1) and the scale and zero of its own rows' group, so
that nothing changes layout: no barrier and no shared memory in the loop. The price is
each thread scaling its own activations and making its own zero pairs.

Timed in a CUDA graph at Llama-3.1-8B's projections (group 128) over tiles and K splits,
against the shipped kernel (which includes the split's second launch; so do these), with
each one's error against a float64 product.

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/int4_gluon_experiment.py
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from benchmarks.gpu.graph_timing import graph_us
from benchmarks.gpu.int4_packed_experiment import (GROUP, SHAPES, exact_product,
                                                   random_projection)
from kernels.gemv import sum_splits
from kernels.int4 import WORD_SUM_ASM, w4a16_gemm_triton

TILES = [(bn, vec, warps) for bn, vec, warps in
         [(16, 2, 4), (32, 2, 4), (64, 2, 8), (32, 2, 8), (64, 2, 4), (16, 4, 4), (32, 4, 4),
          (32, 4, 8), (8, 4, 2), (16, 1, 4), (32, 1, 4)]]


@gluon.jit
def _half_pair(low, high):
    return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [low, high],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _zero_pairs(z):
    """z (uint8, at most 16) -> the f16x2 pairs (1024 + z, 1024 + z) and (-64 - z, -64 - z)
    by their bits: fp16's 1024 is 0x6400 with a step of 1 there, -64 is 0xD400 with a step
    of 1/16."""
    zi = z.to(gl.int32)
    return (0x6400 + zi) * 0x10001, (0xD400 + zi * 16) * 0x10001


@gluon.jit
def _x_pairs(x8, COLS_LAYOUT: gl.constexpr):
    """x8 [L, VEC, 8] float32 -> the four f16x2 pairs (x0, x4) .. (x3, x7) and the
    power-of-two `down` of each word column, in COLS_LAYOUT."""
    largest = gl.max(gl.abs(x8), axis=2)
    power = gl.maximum(largest.to(gl.int32, bitcast=True) & 0x7F800000, 8 << 23)
    up = ((254 << 23) - power + (7 << 23)).to(gl.float32, bitcast=True)
    down = (power - (7 << 23)).to(gl.float32, bitcast=True)
    xs = x8 * gl.expand_dims(up, 2)
    L: gl.constexpr = x8.shape[0]
    V: gl.constexpr = x8.shape[1]
    x4a, x4b = gl.split(gl.reshape(xs, [L, V, 4, 2]))   # j even, j odd
    x2a, x2b = gl.split(gl.reshape(x4a, [L, V, 2, 2]))  # (0, 4) ; (2, 6)
    x2c, x2d = gl.split(gl.reshape(x4b, [L, V, 2, 2]))  # (1, 5) ; (3, 7)
    x0, x4 = gl.split(x2a)
    x2, x6 = gl.split(x2b)
    x1, x5 = gl.split(x2c)
    x3, x7 = gl.split(x2d)
    return (gl.convert_layout(_half_pair(x0, x4), COLS_LAYOUT),
            gl.convert_layout(_half_pair(x1, x5), COLS_LAYOUT),
            gl.convert_layout(_half_pair(x2, x6), COLS_LAYOUT),
            gl.convert_layout(_half_pair(x3, x7), COLS_LAYOUT),
            gl.convert_layout(down, COLS_LAYOUT))


@gluon.jit
def _load(ptrs, ok, EVEN: gl.constexpr):
    if EVEN:
        return gl.load(ptrs)
    return gl.load(ptrs, mask=ok, other=0)


@gluon.jit
def _w4a16_gemv_gluon(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, n, k, k_share,
                      group_size: gl.constexpr, BLOCK_N: gl.constexpr, VEC: gl.constexpr,
                      WARPS: gl.constexpr, EVEN_N: gl.constexpr, PDL: gl.constexpr):
    COLS: gl.constexpr = 32 * VEC
    BLOCK_K: gl.constexpr = 8 * COLS
    L3: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0])
    LG: gl.constexpr = gl.SliceLayout(2, L3)
    LC: gl.constexpr = gl.SliceLayout(0, L3)
    LX: gl.constexpr = gl.BlockedLayout([1, VEC, 8], [32, 1, 1], [WARPS, 1, 1], [2, 1, 0])
    if PDL:
        gdc_launch_dependents()
    stripe = gl.program_id(0)
    share = gl.program_id(1)
    r = stripe * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LG))
    r_ok = (r < n) | EVEN_N
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, LG))
    v = gl.arange(0, VEC, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    r2 = gl.expand_dims(r, 1)                      # [BN, 1] LG
    c2 = gl.expand_dims(c, 0)                      # [1, 32] LG
    word_at = gl.expand_dims(c2 * VEC, 2) + gl.expand_dims(gl.expand_dims(v, 0), 1)
    w_rows = qweight_ptr + gl.expand_dims(r2.to(gl.int64) * (k // 8), 2) + word_at
    ok3 = gl.expand_dims(gl.expand_dims(r_ok, 1), 2)
    g_rows = r2 * (k // group_size) + (c2 * (VEC * 8)) // group_size
    ok2 = gl.expand_dims(r_ok, 1)
    xc = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
    xv = gl.arange(0, VEC, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
    xj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))
    x_at = (gl.expand_dims(gl.expand_dims(xc * VEC, 1) + gl.expand_dims(xv, 0), 2) * 8
            + gl.expand_dims(gl.expand_dims(xj, 0), 1))
    k_lo = share * k_share
    k_hi = gl.minimum(k_lo + k_share, k)
    lanes = gl.zeros([BLOCK_N, 32], gl.float32, LG)
    words = _load(w_rows + k_lo // 8, ok3, EVEN_N)
    s = _load(scales_ptr + g_rows + k_lo // group_size, ok2, EVEN_N)
    z = _load(zeros_ptr + g_rows + k_lo // group_size, ok2, EVEN_N)
    if PDL:
        gdc_wait()
    x8 = gl.load(x_ptr + k_lo + x_at).to(gl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        nxt = gl.where(k0 + BLOCK_K < k_hi, k0 + BLOCK_K, k0)
        next_words = _load(w_rows + nxt // 8, ok3, EVEN_N)
        next_s = _load(scales_ptr + g_rows + nxt // group_size, ok2, EVEN_N)
        next_z = _load(zeros_ptr + g_rows + nxt // group_size, ok2, EVEN_N)
        next_x8 = gl.load(x_ptr + nxt + x_at)
        p0, p1, p2, p3, down = _x_pairs(x8, LC)
        z1, z2 = _zero_pairs(z)
        z1 = gl.expand_dims(z1, 2)
        z2 = gl.expand_dims(z2, 2)
        shape: gl.constexpr = [BLOCK_N, 32, VEC]
        sums = gl.inline_asm_elementwise(
            WORD_SUM_ASM, "=r,r,r,r,r,r,r,r",
            [words, gl.broadcast(gl.expand_dims(p0, 0), words)[0],
             gl.broadcast(gl.expand_dims(p1, 0), words)[0],
             gl.broadcast(gl.expand_dims(p2, 0), words)[0],
             gl.broadcast(gl.expand_dims(p3, 0), words)[0],
             gl.broadcast(z1, words)[0], gl.broadcast(z2, words)[0]],
            dtype=gl.int32, is_pure=True, pack=1)
        sums = sums.to(gl.float32, bitcast=True) * gl.expand_dims(down, 0)
        lanes += gl.sum(sums, axis=2) * s.to(gl.float32)
        words, s, z, x8 = next_words, next_s, next_z, next_x8.to(gl.float32)
    acc = gl.sum(lanes, axis=1)
    gl.store(out_ptr + share * n + r, acc, mask=r_ok)


def gluon_gemv(x, qweight, scales, zeros, bn, vec, warps, split):
    n, k = qweight.shape[0], qweight.shape[1] * 8
    k_share = k // split
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, 1, n, dtype=torch.float32, device=x.device)
    _w4a16_gemv_gluon[(triton.cdiv(n, bn), split)](
        x, qweight, scales, zeros, out, n, k, k_share, group_size=GROUP, BLOCK_N=bn, VEC=vec,
        WARPS=warps, EVEN_N=n % bn == 0, PDL=True, num_warps=warps, launch_pdl=True)
    if split > 1:
        sum_splits(out, None, y)
    return y


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), triton.__version__, flush=True)
    best_total, shipped_total = 0.0, 0.0
    for name, (k, n) in SHAPES.items():
        x, qweight, scales, zeros, nbytes = random_projection(k, n)
        exact = exact_product(x, qweight, scales, zeros)

        def error(y: torch.Tensor) -> float:
            return ((y.double() - exact).norm() / exact.norm()).item()

        shipped = graph_us(lambda: w4a16_gemm_triton(x, qweight, scales, zeros, GROUP),
                           calls=50)
        shipped_total += shipped
        print(f"{name} K {k} N {n}: shipped {shipped:.1f} us {nbytes / shipped / 1e6:.2f} TB/s "
              f"error {error(w4a16_gemm_triton(x, qweight, scales, zeros, GROUP)):.2e}",
              flush=True)
        rows = []
        for bn, vec, warps in TILES:
            for split in (1, 2, 4):
                if (k // split) % (256 * vec) or n % bn:
                    continue
                try:
                    us = graph_us(lambda: gluon_gemv(x, qweight, scales, zeros, bn, vec,
                                                     warps, split), calls=50)
                except Exception as exc:  # noqa: BLE001 - past the chip's resources
                    print(f"  n{bn} vec{vec} w{warps} split{split}: {exc}"[:200])
                    continue
                rows.append((us, bn, vec, warps, split))
        rows.sort()
        for us, bn, vec, warps, split in rows[:5]:
            err = error(gluon_gemv(x, qweight, scales, zeros, bn, vec, warps, split))
            print(f"  gluon n{bn:<3d} vec{vec} w{warps} split{split}: {us:6.1f} us "
                  f"{nbytes / us / 1e6:.2f} TB/s error {err:.2e}", flush=True)
        best_total += rows[0][0]
    print(f"a layer: shipped {shipped_total:.1f} us, gluon's best tiles {best_total:.1f} us")


if __name__ == "__main__":
    main()

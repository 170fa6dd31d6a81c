"""What bounds the int4 GEMV at one row (issue 30: 8B batch-1 decode at 2.4 ms needs the
projections near the HBM rate): the shipped kernel against variants of its loop at the
same tiles and Llama-3.1-8B's projections, each replayed in a CUDA graph.

- `read`: the loop's loads only (the words XOR-ed together): the rate this access pattern
  can read at, whatever the arithmetic costs (and the same for the fp8 GEMV's bytes).
- `f16x2`: each word's eight nibbles turned into four packed half pairs (one LOP3 each, the
  exponent of 1024 OR-ed in), less the zero in packed arithmetic, multiplied by x with
  packed fused multiply-adds, and only the word's sum widened to float32. kernels/int4.py
  took this form (the loop here is its own, at the sweep's tiles); its first run scaled x
  by 2^-5, not per word.
- `pairs`: the same, with x read as bf16 pairs and permuted with PRMT.

It also checks each against a float64 product, and writes the SASS of the shipped kernel
and of `pairs` under $R (the loop: 6.5 instructions a weight in float32, 4.1 packed).
First run, before kernels/int4.py changed: benchmarks/issue30-h100/s6/int4-packed-*.txt.

    source .devkit/env.sh && R=/tmp PYTHONPATH=. python benchmarks/gpu/int4_packed_experiment.py
"""

from __future__ import annotations

import collections
import os
import re
import sys

import torch
import triton
import triton.language as tl

from benchmarks.gpu.graph_timing import graph_us
from kernels.int4 import (TUNED_GEMV_TILES, WORD_SUM_ASM, _packed_nibble_sums, _per_word,
                          unpack_int4, w4a16_gemm_ref, w4a16_gemm_triton)
from kernels.packed_half import half_pair

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
GROUP = 128
TILES = [(bn, bk, w) for bn in (16, 32, 64) for bk in (512, 1024) for w in (4, 8)] + [
    (64, 256, 4), (128, 256, 4), (128, 256, 8), (64, 256, 8)]
# x's bf16 pairs (x0, x1) and (x4, x5) -> the f16x2 pair (x0, x4) (selector 0x5410) or
# (x1, x5) (0x7632), scaled by 2^-8 in float32 first
X_PAIR_ASM = """
{
.reg .b32 p, lo, hi;
prmt.b32 p, $1, $2, SELECT;
shl.b32 lo, p, 16;
and.b32 hi, p, 0xFFFF0000;
mul.f32 lo, lo, 0f3B800000;
mul.f32 hi, hi, 0f3B800000;
cvt.rn.f16x2.f32 $0, hi, lo;
}
"""
X_EVEN = tl.constexpr(X_PAIR_ASM.replace("SELECT", "0x5410"))
X_ODD = tl.constexpr(X_PAIR_ASM.replace("SELECT", "0x7632"))



@triton.jit
def _experiment_kernel(x_ptr, x32_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, n, k,
                       group_size, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                       MODE: tl.constexpr):
    """MODE 0: loads only; 1: the shipped packed loop; 2: the same with x read as pairs.
    One row, no split, no PDL."""
    stripe = tl.program_id(0)
    offs_n = stripe * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    cols = tl.arange(0, BLOCK_K // 8)
    per_group: tl.constexpr = BLOCK_K // 8 // GROUPS
    w_rows = qweight_ptr + offs_n.to(tl.int64)[:, None] * (k // 8) + cols[None, :]
    at_group = (offs_n * (k // group_size))[:, None] + tl.arange(0, GROUPS)[None, :]
    x_at = cols[:, None] * 8 + tl.arange(0, 8)[None, :]
    x4_at = cols[:, None] * 4 + tl.arange(0, 4)[None, :]
    lanes = tl.zeros((BLOCK_N, GROUPS, per_group), dtype=tl.float32)
    bits = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.int32)
    words = tl.load(w_rows, mask=n_ok[:, None], other=0)
    s = tl.load(scales_ptr + at_group, mask=n_ok[:, None], other=0.0)
    z = tl.load(zeros_ptr + at_group, mask=n_ok[:, None], other=0)
    x8 = tl.load(x_ptr + x_at).to(tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ahead = (offs_n < tl.where(k0 + BLOCK_K < k, n, 0))[:, None]
        next_words = tl.load(w_rows + (k0 + BLOCK_K) // 8, mask=ahead, other=0)
        next_s = tl.load(scales_ptr + at_group + (k0 + BLOCK_K) // group_size, mask=ahead,
                         other=0.0)
        next_z = tl.load(zeros_ptr + at_group + (k0 + BLOCK_K) // group_size, mask=ahead,
                         other=0)
        next_x8 = tl.load(x_ptr + tl.minimum(k0 + BLOCK_K, k - BLOCK_K) + x_at).to(tl.float32)
        if MODE == 0:
            bits ^= words
        elif MODE == 2:
            # x as int32 words of two bf16: (x0 x1, x2 x3, x4 x5, x6 x7) a weight word
            xw = tl.reshape(tl.load(x32_ptr + (k0 // 2) + x4_at), (BLOCK_K // 8, 2, 2))
            ac, bd = tl.split(xw)  # (x0x1, x4x5), (x2x3, x6x7)
            xa_, xc_ = tl.split(ac)
            xb_, xd_ = tl.split(bd)
            pa = tl.inline_asm_elementwise(X_EVEN, "=r,r,r", [xa_, xc_], dtype=tl.int32,
                                           is_pure=True, pack=1)
            pb = tl.inline_asm_elementwise(X_ODD, "=r,r,r", [xa_, xc_], dtype=tl.int32,
                                           is_pure=True, pack=1)
            pc = tl.inline_asm_elementwise(X_EVEN, "=r,r,r", [xb_, xd_], dtype=tl.int32,
                                           is_pure=True, pack=1)
            pd = tl.inline_asm_elementwise(X_ODD, "=r,r,r", [xb_, xd_], dtype=tl.int32,
                                           is_pure=True, pack=1)
            zf = z.to(tl.float32)
            z1 = _per_word(half_pair(1024.0 + zf, 1024.0 + zf), BLOCK_N, BLOCK_K, GROUPS)
            z2 = _per_word(half_pair(-64.0 - zf, -64.0 - zf), BLOCK_N, BLOCK_K, GROUPS)
            sums = tl.inline_asm_elementwise(
                WORD_SUM_ASM, "=r,r,r,r,r,r,r,r",
                [words, tl.broadcast_to(pa[None, :], (BLOCK_N, BLOCK_K // 8)),
                 tl.broadcast_to(pb[None, :], (BLOCK_N, BLOCK_K // 8)),
                 tl.broadcast_to(pc[None, :], (BLOCK_N, BLOCK_K // 8)),
                 tl.broadcast_to(pd[None, :], (BLOCK_N, BLOCK_K // 8)), z1, z2],
                dtype=tl.int32, is_pure=True, pack=1)
            sums = tl.reshape(sums.to(tl.float32, bitcast=True), (BLOCK_N, GROUPS, per_group))
            lanes += sums * s.to(tl.float32)[:, :, None]
        else:
            sums = _packed_nibble_sums(words, x8, z, BLOCK_N, BLOCK_K, GROUPS)
            lanes += sums * s.to(tl.float32)[:, :, None]
        words, s, z, x8 = next_words, next_s, next_z, next_x8
    if MODE == 0:
        acc = tl.sum(bits, axis=1).to(tl.float32)
    else:  # pairs: x came in at 2^-8
        acc = tl.sum(tl.sum(lanes, axis=2), axis=1) * (256.0 if MODE == 2 else 1.0)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def experiment(x, qweight, scales, zeros, mode: int, bn: int, bk: int, warps: int):
    n, k = qweight.shape[0], qweight.shape[1] * 8
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _experiment_kernel[(triton.cdiv(n, bn),)](
        x, x.view(torch.int32), qweight, scales, zeros, y, n, k, GROUP, BLOCK_N=bn, BLOCK_K=bk,
        GROUPS=max(1, bk // GROUP), MODE=mode, num_warps=warps,
        num_stages=1)
    return y


def sass_opcodes(kernel, label: str) -> collections.Counter:
    from triton.tools.disasm import get_sass
    sass = get_sass(kernel.asm["cubin"])
    out = os.environ.get("R")
    if out:
        with open(f"{out}/{label}.sass", "w") as f:
            f.write(sass)
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    return collections.Counter(op.split(".")[0] for op in ops)


def random_projection(k: int, n: int) -> tuple[torch.Tensor, ...]:
    """A random [n, k] int4 projection at group GROUP on CUDA (any nibble, zeros 0..15,
    scales up to 0.01), a bf16 row of x, and the bytes the weights take:
    (x, qweight, scales, zeros, nbytes). The int4 experiments share it."""
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32,
                            device="cuda")
    scales = (torch.rand(n, k // GROUP, device="cuda") * 0.01).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // GROUP), dtype=torch.uint8, device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    return x, qweight, scales, zeros, qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()


def exact_product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor) -> torch.Tensor:
    """x W^T in float64, W dequantized exactly: [1, n]."""
    w = ((unpack_int4(qweight).double() - zeros.double().repeat_interleave(GROUP, 1))
         * scales.double().repeat_interleave(GROUP, 1))
    return x.double() @ w.T


def main() -> None:
    torch.manual_seed(0)
    for name, (k, n) in SHAPES.items():
        x, qweight, scales, zeros, nbytes = random_projection(k, n)
        ref = w4a16_gemm_ref(x, qweight, scales, zeros, GROUP).float()
        shipped = w4a16_gemm_triton(x, qweight, scales, zeros, GROUP).float()
        got = experiment(x, qweight, scales, zeros, 1, 32, 1024, 8).float()
        got2 = experiment(x, qweight, scales, zeros, 2, 32, 1024, 8).float()
        exact = exact_product(x, qweight, scales, zeros).float()
        scale = exact.abs().max().item()
        print(f"{name} K {k} N {n}: max |err| / max |y| against float64: twin "
              f"{(ref - exact).abs().max().item() / scale:.2e}, shipped "
              f"{(shipped - exact).abs().max().item() / scale:.2e}, f16x2 "
              f"{(got - exact).abs().max().item() / scale:.2e}, f16x2 pairs "
              f"{(got2 - exact).abs().max().item() / scale:.2e}")
        us = graph_us(lambda: w4a16_gemm_triton(x, qweight, scales, zeros, GROUP))
        print(f"  shipped {TUNED_GEMV_TILES.get((n, k, 132))}: {us:.1f} us "
              f"{nbytes / us / 1e3:.0f} GB/s")
        for mode, label in ((0, "read"), (1, "f16x2"), (2, "pairs")):
            rows = []
            for bn, bk, warps in TILES:
                try:
                    t = graph_us(lambda: experiment(x, qweight, scales, zeros, mode, bn, bk,
                                                    warps))
                except Exception as exc:  # noqa: BLE001 - past the chip's resources
                    print(f"  {label} n{bn} k{bk} w{warps}: {exc}"[:160])
                    continue
                rows.append((t, bn, bk, warps))
            rows.sort()
            for t, bn, bk, warps in rows[:4]:
                print(f"  {label:6s} n{bn:<3d} k{bk:<5d} w{warps}: {t:6.1f} us "
                      f"{nbytes / t / 1e3:5.0f} GB/s")
        # the fp8 GEMV's bytes (one a weight) read by the same loads: K bytes a row are
        # 2K nibbles' words
        fp8_words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 4), dtype=torch.int32,
                                  device="cuda")
        fp8_scales = torch.ones(n, 2 * k // GROUP, device="cuda", dtype=torch.bfloat16)
        fp8_zeros = torch.zeros(n, 2 * k // GROUP, dtype=torch.uint8, device="cuda")
        x2 = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
        rows = []
        for bn, bk, warps in TILES:
            t = graph_us(lambda: experiment(x2, fp8_words, fp8_scales, fp8_zeros, 0, bn, bk,
                                            warps))
            rows.append((t, bn, bk, warps))
        t, bn, bk, warps = min(rows)
        print(f"  fp8 read n{bn} k{bk // 2} bytes w{warps}: {t:6.1f} us "
              f"{n * k / t / 1e3:5.0f} GB/s of weights")
        sys.stdout.flush()
    gate_up = (4096, 28672)
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (gate_up[1], gate_up[0] // 8),
                            dtype=torch.int32, device="cuda")
    scales = torch.ones(gate_up[1], gate_up[0] // GROUP, device="cuda", dtype=torch.bfloat16)
    zeros = torch.full((gate_up[1], gate_up[0] // GROUP), 8, dtype=torch.uint8, device="cuda")
    x = torch.randn(1, gate_up[0], device="cuda", dtype=torch.bfloat16)
    w4a16_gemm_triton(x, qweight, scales, zeros, GROUP)
    from kernels.int4 import _w4a16_gemv_kernel
    _experiment_kernel.device_caches[0][0].clear()
    experiment(x, qweight, scales, zeros, 2, 32, 512, 4)
    for label, fn in (("shipped", _w4a16_gemv_kernel), ("pairs", _experiment_kernel)):
        for i, kernel in enumerate(list(fn.device_caches[0][0].values())):
            try:
                ops = sass_opcodes(kernel, f"{label}{i}")
            except Exception as exc:  # noqa: BLE001 - no disassembler in this image
                print(f"{label}: no SASS ({exc})"[:200])
                break
            print(f"{label} SASS, {sum(ops.values())} instructions: "
                  + ", ".join(f"{op} {c}" for op, c in ops.most_common(18)))


if __name__ == "__main__":
    main()

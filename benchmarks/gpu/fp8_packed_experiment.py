"""Whether the fp8 weight-only GEMV at one row is bound by its arithmetic, as the int4 one
was (benchmarks/gpu/int4_packed_experiment.py): the shipped kernel at its tuned tiles
against a loop that turns each word's four e4m3 weights into two f16x2 pairs (one CVT per
pair) and multiplies them with the activations in packed fp16 (each word's four scaled by
the power of two that keeps its products and their sum in fp16's range), widening only the
word's sum to float32; and against the same loop's loads alone. Llama-3.1-8B's projections,
per-channel scales, each replayed in a CUDA graph. kernels/fp8_gemv.py took the packed
loop (so "shipped" is that kernel from then on); the first run, before, paired the
activations wrongly (its errors of 1.0), which changes nothing of its times
(benchmarks/issue30-h100/s6/fp8/).

    source .devkit/env.sh && PYTHONPATH=. python benchmarks/gpu/fp8_packed_experiment.py
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from benchmarks.gpu.graph_timing import graph_us
from kernels.fp8_gemv import _packed_word_sums, fp8_gemv_ref, fp8_gemv_triton

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096)}
TILES = [(bn, bk, w) for bn in (8, 16, 32) for bk in (512, 1024, 2048) for w in (4, 8)]


@triton.jit
def _kernel(x_ptr, w_ptr, scale_ptr, out_ptr, n, k, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: loads only; 1: the shipped packed loop (without masks, PDL or scale blocks).
    w as int32 words [N, K / 4]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    cols = tl.arange(0, BLOCK_K // 4)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * (k // 4) + cols[None, :]
    x_at = cols[:, None] * 4 + tl.arange(0, 4)[None, :]
    lanes = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.float32)
    bits = tl.zeros((BLOCK_N, BLOCK_K // 4), dtype=tl.int32)
    words = tl.load(w_rows, mask=n_ok[:, None], other=0)
    x4 = tl.load(x_ptr + x_at).to(tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ahead = (offs_n < tl.where(k0 + BLOCK_K < k, n, 0))[:, None]
        next_words = tl.load(w_rows + (k0 + BLOCK_K) // 4, mask=ahead, other=0)
        next_x4 = tl.load(x_ptr + tl.minimum(k0 + BLOCK_K, k - BLOCK_K) + x_at).to(tl.float32)
        if MODE == 0:
            bits ^= words
        else:
            lanes += _packed_word_sums(words, x4, BLOCK_N, BLOCK_K)
        words, x4 = next_words, next_x4
    if MODE == 0:
        acc = tl.sum(bits, axis=1).to(tl.float32)
    else:
        acc = tl.sum(lanes, axis=1) * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def run(x, words, scale, mode, bn, bk, warps):
    n, k = words.shape[0], words.shape[1] * 4
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _kernel[(triton.cdiv(n, bn),)](x, words, scale, y, n, k, BLOCK_N=bn, BLOCK_K=bk,
                                   MODE=mode, num_warps=warps, num_stages=1)
    return y


def main() -> None:
    torch.manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda") * 2).to(torch.float8_e4m3fn)
        scale = torch.rand(n, 1, device="cuda") * 0.01 + 0.001
        words = w.view(torch.int32)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) * 3
        exact = (x.double() @ (w.double() * scale.double()).T).float()
        top = exact.abs().max().item()
        shipped = fp8_gemv_triton(x, w, scale.reshape(-1))
        packed = run(x, words, scale.reshape(-1), 1, 16, 1024, 4)
        ref = fp8_gemv_ref(x, w, scale.reshape(-1))
        print(f"{name} K {k} N {n}: max |err| / max |y| against float64: twin "
              f"{(ref.float() - exact).abs().max().item() / top:.2e}, shipped "
              f"{(shipped.float() - exact).abs().max().item() / top:.2e}, packed "
              f"{(packed.float() - exact).abs().max().item() / top:.2e}")
        us = graph_us(lambda: fp8_gemv_triton(x, w, scale.reshape(-1)))
        print(f"  shipped: {us:.1f} us {n * k / us / 1e3:.0f} GB/s")
        for mode, label in ((0, "read"), (1, "packed")):
            rows = []
            for bn, bk, warps in TILES:
                try:
                    t = graph_us(lambda: run(x, words, scale.reshape(-1), mode, bn, bk, warps))
                except Exception as exc:  # noqa: BLE001 - past the chip's resources
                    print(f"  {label} n{bn} k{bk} w{warps}: {exc}"[:160])
                    continue
                rows.append((t, bn, bk, warps))
            rows.sort()
            for t, bn, bk, warps in rows[:3]:
                print(f"  {label:6s} n{bn:<3d} k{bk:<5d} w{warps}: {t:6.1f} us "
                      f"{n * k / t / 1e3:5.0f} GB/s")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

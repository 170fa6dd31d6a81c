"""The RMSNorm between two projections, done by the projections themselves (one-row decode
steps): the projection that ends a sublayer (o_proj, down_proj) adds its output to the
residual stream in its epilogue and leaves, beside the sum, each program's sum of that
sum's squares (a ResidualSum); the projection that begins the next sublayer (gate_up_proj,
the next layer's qkv_proj) finishes the norm as it loads its input: one rsqrt over the
parts' total, then the weighting. The norm kernel goes, and with it one link of a decode
step's chain of dependent kernels, which at one row costs its wait and a memory round trip
rather than its work: about half a microsecond each under PDL, 35 us of 2.55 ms a
Llama-3.1-8B fp8 step on an H200 (benchmarks/issue30-h100/README.md, s11).

Rounded where the fused add-and-norm kernel (kernels/norm.py) rounds: the sum to the
activations' dtype, the normed value before the weight, the weighted value. Only the sum of
squares adds up in another order (within stripes, then across them). Llama's weighting
only: Gemma's norms keep their kernels. The torch twins are the unfused ops themselves."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.norm import rms_norm_ref


@dataclass(frozen=True, slots=True)
class ResidualSum:
    """The residual stream after a sublayer's output was added to it, as the projection
    that made the output leaves it: total [rows, hidden] in the activations' dtype, and
    sumsq [rows, parts] float32, the squares of total summed over parts of hidden."""
    total: torch.Tensor
    sumsq: torch.Tensor


@dataclass(frozen=True, slots=True)
class SeamNorm:
    """An RMSNorm still to apply to a ResidualSum's total: the input of the projection that
    applies it as it loads (ColumnParallelLinear given one)."""
    sum: ResidualSum
    weight: torch.Tensor
    eps: float


def residual_sum_ref(y: torch.Tensor, residual: torch.Tensor) -> ResidualSum:
    """The twin of a projection's epilogue: y + residual as the add-and-norm rounds it."""
    total = (y.float() + residual.float()).to(residual.dtype)
    return ResidualSum(total, total.float().pow(2).sum(-1, keepdim=True))


def seam_tensor(x: torch.Tensor | SeamNorm) -> torch.Tensor:
    """The activations a projection's input holds (a SeamNorm's before its norm)."""
    return x.sum.total if isinstance(x, SeamNorm) else x


def seam_input_ref(x: torch.Tensor | SeamNorm) -> torch.Tensor:
    """A twin's input: a SeamNorm normed as the unfused norm does."""
    if isinstance(x, SeamNorm):
        return rms_norm_ref(x.sum.total, x.weight, x.eps)
    return x


def new_residual_sum(residual: torch.Tensor, parts: int) -> ResidualSum:
    """The buffers a one-row projection's epilogue fills."""
    assert residual.is_contiguous(), "the epilogue reads the residual as one row"
    return ResidualSum(torch.empty_like(residual),
                       torch.empty(residual.shape[0], parts, dtype=torch.float32,
                                   device=residual.device))


def seam_arguments(norm: SeamNorm | None, add_to: torch.Tensor | None,
                   result: ResidualSum | None, unused: torch.Tensor) -> tuple:
    """A GEMV launch's seam arguments (res_ptr, sumsq_ptr, norm_w_ptr, parts, eps), and
    its BLOCK_P: a SeamNorm's parts and weight, or the residual to add and the result's
    sumsq; `unused` stands in for the pointers the kernel does not read."""
    if norm is not None:
        parts = norm.sum.sumsq.shape[-1]
        return (unused, norm.sum.sumsq, norm.weight, parts, norm.eps), block_parts(parts)
    if result is not None:
        return (add_to, result.sumsq, unused, 1, 0.0), 1
    return (unused, unused, unused, 1, 0.0), 1


@triton.jit
def seam_inv_rms(sumsq_ptr, parts, hidden, eps, BLOCK_P: tl.constexpr):
    """1 / rms of the row whose squares' parts sumsq_ptr holds (after the wait: the
    previous projection wrote them)."""
    at = tl.arange(0, BLOCK_P)
    total = tl.sum(tl.load(sumsq_ptr + at, mask=at < parts, other=0.0), axis=0)
    return tl.rsqrt(total / hidden + eps)


@triton.jit
def seam_weigh(x, weight, inv_rms):
    """A tile of the residual sum normed and weighted, rounded as Llama's norm rounds
    (kernels/norm.py): the normed value to x's dtype, then the weighted one."""
    normed = (x.to(tl.float32) * inv_rms).to(x.dtype).to(tl.float32)
    return (weight.to(tl.float32) * normed).to(x.dtype)


@triton.jit
def seam_add(acc, residual, total_ptr, offs, mask, sumsq_ptr):
    """A program's epilogue: its outputs (float32 sums) rounded to the residual's dtype,
    added to the residual, the sum stored at offs of total_ptr and its squares' sum at
    sumsq_ptr."""
    y = acc.to(residual.dtype).to(tl.float32)
    total = (y + residual.to(tl.float32)).to(residual.dtype)
    tl.store(total_ptr + offs, total, mask=mask)
    t32 = tl.where(mask, total.to(tl.float32), 0.0)
    tl.store(sumsq_ptr, tl.sum(t32 * t32, axis=0))


def block_parts(parts: int) -> int:
    return triton.next_power_of_2(max(parts, 1))

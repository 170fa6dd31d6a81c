"""RMSNorm, optionally fused with the residual add that precedes it; and Gemma's norm, add,
norm seam between sublayers in one kernel.

Two weightings: Llama's `weight * normed.to(dtype)` and Gemma's `(normed * (1 + weight))`
in float32, cast once at the end (transformers' Gemma RMSNorm; its weights are stored
around 0)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import let_next_start, pdl_launch, wait_for_previous


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, gemma: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with residual: (norm(x + residual) * weight, x + residual).
    gemma: Gemma's weighting (module doc). An x of [T, parts, hidden] with a residual of
    [T, hidden] is summed over its parts first, in float32 and rounded once to the
    residual's dtype as torch sums (a mixture-of-experts layer's top-k outputs, or a GEMV's
    float32 partial sums over a split K: the sum's launch folds into the norm's).
    The one dispatch point for this op: CUDA tensors take the Triton kernel."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps, residual, gemma=gemma)
    return rms_norm_ref(x, weight, eps, residual, gemma)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, gemma: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = sum_parts(x, residual) + residual
    # the statistics in float32 whatever the activation dtype, as the reference models do
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if gemma:  # weighted by 1 + w in float32, rounded once
        out = (normed * (1.0 + weight.float())).to(x.dtype)
    else:
        out = weight * normed.to(x.dtype)
    return out if residual is None else (out, x)


def sum_parts(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """x summed over its parts where it has them, in the residual's dtype (rms_norm's doc),
    else x."""
    return x.sum(1).to(residual.dtype) if x.dim() == residual.dim() + 1 else x


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None, gemma: bool = False
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One program per row. x may be a strided [T, hidden] or [T, heads, head_dim] view
    (the per-head q/k norms read q and k straight out of the fused qkv output), or, with a
    residual, [T, parts, hidden] parts to sum (rms_norm's doc), any strides but the last.
    out and residual_out: contiguous buffers to write into, allocated when None. gemma:
    Gemma's weighting, whose output keeps the activations' dtype (the residual's where
    there is one)."""
    hidden = x.shape[-1]
    assert x.stride(-1) == 1 and weight.is_contiguous() and x.dim() in (2, 3)
    has_residual = residual is not None
    parts = x.shape[1] if has_residual and x.dim() == residual.dim() + 1 else 1
    shape = residual.shape if parts > 1 else x.shape
    dtype = residual.dtype if has_residual else x.dtype  # float32 parts round to it
    out_dtype = dtype if gemma else torch.promote_types(weight.dtype, dtype)
    out = torch.empty(shape, dtype=out_dtype, device=x.device) if out is None else out
    # without a residual, x and out stand in for its pointers, which the kernel never uses
    res = residual if has_residual else x
    if residual_out is None:
        residual_out = torch.empty(shape, dtype=dtype, device=x.device) if has_residual \
            else out
    assert res.shape == shape and res.stride(-1) == 1
    assert out.dtype == out_dtype and out.is_contiguous() and residual_out.is_contiguous()
    inner = x.shape[1] if x.dim() == 3 and parts == 1 else 1
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(out.numel() // hidden,)](
        x, res, weight, out, residual_out, hidden, inner, eps,
        x.stride(0), x.stride(-2), res.stride(0), res.stride(-2),
        HAS_RESIDUAL=has_residual, GEMMA=gemma, PARTS=parts, BLOCK=block,
        num_warps=min(16, max(1, block // 512)), **pdl_launch(x))
    return (out, residual_out) if has_residual else out


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, hidden, inner, eps,
                     stride_x0, stride_x1, stride_r0, stride_r1,
                     HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, PARTS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    """PARTS > 1: x's rows are [PARTS, hidden] blocks (stride_x1 apart) summed first and
    rounded to the residual's dtype."""
    let_next_start(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # the weight is no kernel's output: its load goes out while the previous kernel ends,
    # rather than after the row's reduction, a round trip to memory less a norm
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(PDL)
    outer, within = row // inner, row % inner
    x = tl.load(x_ptr + outer * stride_x0 + within * stride_x1 + cols, mask=mask, other=0.0)
    if PARTS > 1:  # in float32, rounded once, as torch sums a low-precision tensor
        total = x.to(tl.float32)
        for p in tl.static_range(1, PARTS):
            total += tl.load(x_ptr + row * stride_x0 + p * stride_x1 + cols, mask=mask,
                             other=0.0).to(tl.float32)
        x = total.to(new_res_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + outer * stride_r0 + within * stride_r1 + cols, mask=mask,
                      other=0.0)
        # the sum rounded to the activation dtype, as the reference adds before normalizing
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    if GEMMA:  # weighted in float32, rounded once
        y = x32 * inv_rms * (1.0 + w)
    else:  # the normed row rounded to the activation dtype before the weight, as Llama's
        y = w * (x32 * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gemma_norm_add_norm(x: torch.Tensor, residual: torch.Tensor, first_weight: torch.Tensor,
                        second_weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's sublayer seam: (norm2(norm1(x) + residual), norm1(x) + residual), both norms
    with Gemma's weighting. One launch instead of two at decode, and norm1(x) never goes
    to memory. The one dispatch point for this op: CUDA tensors take the Triton kernel."""
    if x.is_cuda:
        return gemma_norm_add_norm_triton(x, residual, first_weight, second_weight, eps)
    return gemma_norm_add_norm_ref(x, residual, first_weight, second_weight, eps)


def gemma_norm_add_norm_ref(x: torch.Tensor, residual: torch.Tensor, first_weight: torch.Tensor,
                            second_weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    normed = rms_norm_ref(x, first_weight, eps, gemma=True)
    return rms_norm_ref(normed, second_weight, eps, residual, gemma=True)


def gemma_norm_add_norm_triton(x: torch.Tensor, residual: torch.Tensor,
                               first_weight: torch.Tensor, second_weight: torch.Tensor,
                               eps: float, out: torch.Tensor | None = None,
                               residual_out: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row of [T, hidden] inputs (last dim contiguous); out and
    residual_out: contiguous buffers to write into, allocated when None."""
    hidden = x.shape[-1]
    assert x.dim() == 2 and x.stride(-1) == 1 and residual.shape == x.shape
    assert residual.stride(-1) == 1
    assert first_weight.is_contiguous() and second_weight.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) \
        if residual_out is None else residual_out
    assert out.is_contiguous() and residual_out.is_contiguous()
    block = triton.next_power_of_2(hidden)
    _gemma_norm_add_norm_kernel[(x.shape[0],)](
        x, residual, first_weight, second_weight, out, residual_out, hidden, eps,
        x.stride(0), residual.stride(0), BLOCK=block, num_warps=min(16, max(1, block // 512)))
    return out, residual_out


@triton.jit
def _gemma_norm_add_norm_kernel(x_ptr, res_ptr, w1_ptr, w2_ptr, out_ptr, new_res_ptr, hidden,
                                eps, stride_x, stride_r, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    w1 = tl.load(w1_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # rounded where the twin rounds: the first norm's output, then the sum
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps) * (1.0 + w1)).to(x.dtype)
    res = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    summed = (normed.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
    tl.store(new_res_ptr + row * hidden + cols, summed, mask=mask)
    s32 = summed.to(tl.float32)
    w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = s32 * tl.rsqrt(tl.sum(s32 * s32, axis=0) / hidden + eps) * (1.0 + w2)
    tl.store(out_ptr + row * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

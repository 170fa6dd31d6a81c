"""Mixed-batch LoRA: each token row adds its own adapter's low-rank update.

The adapters of a step sit in `S` slots of stacked weights, `a` [S, R, in] and `b`
[S, out, R] (rank padded with zeros to R), and `slots` [T] names each token's slot, -1 for
the base model. delta[t] = scaling[s] * (x[t] a[s]^T) b[s]^T with s = slots[t], zero where
s < 0. The slot index is read on the device, so a step replays in a CUDA graph with the
index in a static buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# input features per shrink iteration and output features per expand program: wide enough
# for 16-byte loads, small enough that one decode row still spreads over the SMs
BLOCK_IN = 256
BLOCK_OUT = 128


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """x: [T, in] -> [T, out] in x's dtype. The one dispatch point for this op: CUDA
    tensors take the Triton kernels."""
    if x.is_cuda:
        return lora_delta_triton(x, a, b, scaling, slots)
    return lora_delta_ref(x, a, b, scaling, slots)


def lora_delta_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """One gathered low-rank product per slot present, in float32."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        shrunk = x[rows].float() @ a[slot].float().T
        out[rows] = scaling[slot].float() * (shrunk @ b[slot].float().T)
    return out.to(x.dtype)


def lora_delta_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      scaling: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Shrink (x a^T, scaled, float32 [T, R]) then expand (· b^T), one program per token
    (and output block): decode rows of different adapters cost the same as one adapter."""
    tokens, in_features = x.shape
    rank, out_features = a.shape[1], b.shape[1]
    assert x.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    shrunk = torch.empty(tokens, rank, dtype=torch.float32, device=x.device)
    out = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_rank = max(16, triton.next_power_of_2(rank))
    _lora_shrink_kernel[(tokens,)](
        x, a, scaling, slots, shrunk, in_features, rank, x.stride(0),
        BLOCK_IN=min(BLOCK_IN, triton.next_power_of_2(in_features)), BLOCK_RANK=block_rank)
    block_out = min(BLOCK_OUT, triton.next_power_of_2(out_features))
    _lora_expand_kernel[(tokens, triton.cdiv(out_features, block_out))](
        shrunk, b, slots, out, out_features, rank, BLOCK_OUT=block_out, BLOCK_RANK=block_rank)
    return out


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, scaling_ptr, slots_ptr, shrunk_ptr, in_features, rank,
                        x_stride, BLOCK_IN: tl.constexpr, BLOCK_RANK: tl.constexpr):
    token = tl.program_id(0)
    # base-model rows (slot -1) read nothing: their bounds are 0 (masks rather than a
    # data-dependent branch, which older Triton interpreters cannot evaluate)
    slot = tl.load(slots_ptr + token)
    active = slot >= 0
    width = tl.where(active, in_features, 0)
    ranks = tl.arange(0, BLOCK_RANK)
    acc = tl.zeros((BLOCK_RANK,), dtype=tl.float32)
    a_rows = (a_ptr + tl.maximum(slot, 0).to(tl.int64) * rank * in_features
              + ranks[:, None] * in_features)
    for start in range(0, in_features, BLOCK_IN):
        cols = start + tl.arange(0, BLOCK_IN)
        x = tl.load(x_ptr + token * x_stride + cols, mask=cols < width, other=0.0)
        a = tl.load(a_rows + cols[None, :],
                    mask=(ranks[:, None] < rank) & (cols[None, :] < width), other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    acc *= tl.where(active, tl.load(scaling_ptr + tl.maximum(slot, 0)).to(tl.float32), 0.0)
    tl.store(shrunk_ptr + token * rank + ranks, acc, mask=ranks < rank)


@triton.jit
def _lora_expand_kernel(shrunk_ptr, b_ptr, slots_ptr, out_ptr, out_features, rank,
                        BLOCK_OUT: tl.constexpr, BLOCK_RANK: tl.constexpr):
    token, block = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    depth = tl.where(slot >= 0, rank, 0)  # base rows read nothing: see the shrink kernel
    rows = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    ranks = tl.arange(0, BLOCK_RANK)
    h = tl.load(shrunk_ptr + token * rank + ranks, mask=ranks < depth, other=0.0)
    b = tl.load(b_ptr + tl.maximum(slot, 0).to(tl.int64) * out_features * rank
                + rows[:, None] * rank + ranks[None, :],
                mask=(rows[:, None] < out_features) & (ranks[None, :] < depth),
                other=0.0)
    acc = tl.sum(b.to(tl.float32) * h[None, :], axis=1)
    tl.store(out_ptr + token * out_features + rows, acc.to(out_ptr.dtype.element_ty),
             mask=rows < out_features)

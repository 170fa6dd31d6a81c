"""Mixed-batch LoRA: each token row adds its own adapter's low-rank update.

A LoRA-wrapped projection fuses up to three PEFT modules (q/k/v, gate/up), its "slices",
each owning a range of output rows. The adapters of a step sit in `S` slots: `a`
[slices * S * R, in] stacks every slice's and slot's A (slice-major, rank padded with zeros
to R), `b` [S, out, R] holds each slot's B of every slice at the slice's rows. `slots` [T]
names each token's slot, -1 for the base model. Row o of slice i gets
y[t, o] += scaling[s] * (x[t] a[i, s]^T) b[s, o]^T with s = slots[t], nothing where s < 0.

Two launches per projection, whatever the mix: the shrink is one dense GEMM of every token
against every slot's A (R * S columns are few: the waste is cheap and cuBLAS splits the long
input dimension well), the expand one Triton kernel that picks each token's slot and slice
and adds into the projection's output in place. The slot index is read on the device, so a
step replays in a CUDA graph with the index in a static buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# output features per expand program: wide enough for 16-byte loads, small enough that
# one decode row still spreads over the SMs
BLOCK_OUT = 128


MAX_SLICES = 3


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: torch.Tensor, slots: torch.Tensor, starts: tuple[int, ...]) -> None:
    """y [T, out] += each token's adapter delta; x [T, in]; `starts`: the first output row
    of each slice after the first. The one dispatch point for this op: CUDA tensors take
    the Triton expand."""
    if x.is_cuda:
        add_lora_triton(y, x, a, b, scaling, slots, starts)
    else:
        add_lora_ref(y, x, a, b, scaling, slots, starts)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 scaling: torch.Tensor, slots: torch.Tensor, starts: tuple[int, ...]) -> None:
    """One gathered low-rank product per slot and slice present, in float32."""
    num_slots, out_features, rank = b.shape
    a = a.view(len(starts) + 1, num_slots, rank, -1)
    bounds = [0, *starts, out_features]
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            shrunk = x[rows].float() @ a[i, slot].float().T
            delta = scaling[slot].float() * (shrunk @ b[slot, lo:hi].float().T)
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)


def add_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scaling: torch.Tensor, slots: torch.Tensor,
                    starts: tuple[int, ...]) -> None:
    tokens = x.shape[0]
    num_slots, out_features, rank = b.shape
    assert len(starts) < MAX_SLICES and y.stride(1) == 1 and b.is_contiguous()
    if tokens == 0:
        return
    shrunk = x @ a.T  # [T, slices * S * R], in x's dtype as PEFT's own lora_A output
    bound1, bound2 = (*starts, out_features, out_features)[:2]
    block_out = min(BLOCK_OUT, triton.next_power_of_2(out_features))
    _lora_expand_add_kernel[(tokens, triton.cdiv(out_features, block_out))](
        y, shrunk, b, scaling, slots, out_features, y.stride(0), shrunk.stride(0), num_slots,
        rank, bound1, bound2, BLOCK_OUT=block_out,
        BLOCK_RANK=max(16, triton.next_power_of_2(rank)))


@triton.jit
def _lora_expand_add_kernel(y_ptr, shrunk_ptr, b_ptr, scaling_ptr, slots_ptr, out_features,
                            y_stride, shrunk_stride, num_slots, rank, bound1, bound2,
                            BLOCK_OUT: tl.constexpr, BLOCK_RANK: tl.constexpr):
    token, block = tl.program_id(0), tl.program_id(1)
    # base-model rows (slot -1) read and write nothing: masks rather than a data-dependent
    # branch, which older Triton interpreters cannot evaluate
    slot = tl.load(slots_ptr + token)
    width = tl.where(slot >= 0, out_features, 0)
    slot = tl.maximum(slot, 0)
    rows = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    live = rows < width
    piece = (rows >= bound1).to(tl.int32) + (rows >= bound2).to(tl.int32)  # each row's slice
    ranks = tl.arange(0, BLOCK_RANK)
    mask = live[:, None] & (ranks[None, :] < rank)
    h = tl.load(shrunk_ptr + token * shrunk_stride
                + (piece[:, None] * num_slots + slot) * rank + ranks[None, :],
                mask=mask, other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * out_features * rank + rows[:, None] * rank
                + ranks[None, :], mask=mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * h.to(tl.float32), axis=1)
    delta *= tl.load(scaling_ptr + slot).to(tl.float32)
    out = y_ptr + token.to(tl.int64) * y_stride + rows
    y = tl.load(out, mask=live, other=0.0)
    tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=live)

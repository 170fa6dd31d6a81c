"""Mixed-batch LoRA: each token row adds its own adapter's low-rank update.

A LoRA-wrapped projection fuses up to three PEFT modules (q/k/v, gate/up), its "slices",
each owning a range of output rows. The adapters of a step sit in `S` slots: A of every
slice and slot stacked slice-major, [slices * S * R, in] (rank padded with zeros to R), and
`b` [S, out, R], each slot's B of every slice at the slice's rows. `slots` [T] names each
token's slot, -1 for the base model. Row o of slice i gets
y[t, o] += scaling[s] * (x[t] a[i, s]^T) b[s, o]^T with s = slots[t], nothing where s < 0.

The shrink costs no launch of its own: the stacked A rows sit below the base weight, so the
projection's one matmul also yields every token's product with every slot's A (R * S more
output columns; the waste on other slots' columns is cheap). `lora_expand` then picks each
token's slot and slice from those columns, multiplies by B and writes the projection's
output with the delta added: one more launch per projection, whatever the mix. The slot
index is read on the device, so a step replays in a CUDA graph with the index in a static
buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# output features per expand program: wide enough for 16-byte loads, small enough that
# one decode row still spreads over the SMs
BLOCK_OUT = 128


MAX_SLICES = 3


def lora_expand(y_ext: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                slots: torch.Tensor, starts: tuple[int, ...]) -> torch.Tensor:
    """y_ext [T, out + slices * S * R], the matmul by the base weight with A stacked below
    it, -> [T, out]: its first `out` columns plus each token's delta. `starts`: the first
    output row of each slice after the first. The one dispatch point for this op: CUDA
    tensors take the Triton kernel."""
    if y_ext.is_cuda:
        return lora_expand_triton(y_ext, b, scaling, slots, starts)
    return lora_expand_ref(y_ext, b, scaling, slots, starts)


def lora_expand_ref(y_ext: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                    slots: torch.Tensor, starts: tuple[int, ...]) -> torch.Tensor:
    """One gathered product per slot and slice present, in float32."""
    num_slots, out_features, rank = b.shape
    y = y_ext[:, :out_features].clone()
    shrunk = y_ext[:, out_features:].view(-1, len(starts) + 1, num_slots, rank)
    bounds = [0, *starts, out_features]
    for slot in slots.unique().tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            delta = scaling[slot].float() * (shrunk[rows, i, slot].float()
                                             @ b[slot, lo:hi].float().T)
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
    return y


def lora_expand_triton(y_ext: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                       slots: torch.Tensor, starts: tuple[int, ...]) -> torch.Tensor:
    tokens = y_ext.shape[0]
    num_slots, out_features, rank = b.shape
    assert len(starts) < MAX_SLICES and y_ext.stride(1) == 1 and b.is_contiguous()
    y = torch.empty(tokens, out_features, dtype=y_ext.dtype, device=y_ext.device)
    if tokens == 0:
        return y
    bound1, bound2 = (*starts, out_features, out_features)[:2]
    block_out = min(BLOCK_OUT, triton.next_power_of_2(out_features))
    _lora_expand_kernel[(tokens, triton.cdiv(out_features, block_out))](
        y_ext, b, scaling, slots, y, out_features, y_ext.stride(0), num_slots, rank, bound1,
        bound2, BLOCK_OUT=block_out, BLOCK_RANK=max(16, triton.next_power_of_2(rank)))
    return y


@triton.jit
def _lora_expand_kernel(y_ext_ptr, b_ptr, scaling_ptr, slots_ptr, y_ptr, out_features,
                        y_ext_stride, num_slots, rank, bound1, bound2,
                        BLOCK_OUT: tl.constexpr, BLOCK_RANK: tl.constexpr):
    token, block = tl.program_id(0), tl.program_id(1)
    # base-model rows (slot -1) read no adapter: their rank bound is 0 (masks rather than
    # a data-dependent branch, which older Triton interpreters cannot evaluate)
    slot = tl.load(slots_ptr + token)
    depth = tl.where(slot >= 0, rank, 0)
    slot = tl.maximum(slot, 0)
    rows = block * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    live = rows < out_features
    piece = (rows >= bound1).to(tl.int32) + (rows >= bound2).to(tl.int32)  # each row's slice
    ranks = tl.arange(0, BLOCK_RANK)
    mask = live[:, None] & (ranks[None, :] < depth)
    row = y_ext_ptr + token.to(tl.int64) * y_ext_stride
    h = tl.load(row + out_features + (piece[:, None] * num_slots + slot) * rank
                + ranks[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * out_features * rank + rows[:, None] * rank
                + ranks[None, :], mask=mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * h.to(tl.float32), axis=1)
    delta *= tl.load(scaling_ptr + slot).to(tl.float32)
    y = tl.load(row + rows, mask=live, other=0.0)
    tl.store(y_ptr + token.to(tl.int64) * out_features + rows,
             (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=live)

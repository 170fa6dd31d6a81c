"""The all-reduce of a row-parallel projection fused with the residual add and RMSNorm that
follow it: out, residual' = rms_norm(sum over ranks of x + residual), as one kernel.

In a tensor-parallel decode step every layer ends twice in this pattern; done separately
it is an all-reduce kernel (two barriers across the GPUs) and a norm kernel. Here each rank
has published its rows in its own half of a double-buffered symmetric buffer (one every
rank maps over NVLink), signals its peers, waits for theirs, and reads their rows straight
into the norm: one barrier, one launch. The halves alternate with a call counter (the
epoch) that every rank advances alike: a rank writes half h again two calls later, by
which time every peer has entered the call between and so has finished reading it.

A fixed grid of at most MAX_PROGRAMS programs walks the rows, so every program is resident
at once on both GPUs: a program spins until its peer's program of the same number has
published, which would deadlock if that one waited for a free SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm import rms_norm_ref

MAX_PROGRAMS = 64


def all_reduce_rms_norm_ref(parts: list[torch.Tensor], residual: torch.Tensor,
                            weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: every rank's part summed in float32, rounded to the activation dtype
    (as an all-reduce hands it over), then the fused add and norm."""
    summed = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    return rms_norm_ref(summed, weight, eps, residual)


def all_reduce_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float, buffers: torch.Tensor, half: int,
                               flags: torch.Tensor, counters: torch.Tensor, rank: int,
                               world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: this rank's partial sums [rows, hidden]. buffers: every rank's address of its
    symmetric data buffer (int64 [world]), each two halves of `half` elements; flags:
    every rank's address of its symmetric int64 flag array [MAX_PROGRAMS, world], zero at
    the start; counters: this rank's int64 [epoch, programs done], zero at the start."""
    rows, hidden = x.shape
    assert x.is_contiguous() and residual.is_contiguous() and residual.shape == x.shape
    assert x.numel() <= half, "more rows than the symmetric buffer holds"
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    programs = min(rows, MAX_PROGRAMS)
    _all_reduce_rms_norm_kernel[(programs,)](
        x, residual, weight, out, new_residual, buffers, flags, counters, rows, hidden,
        eps, RANK=rank, WORLD=world, HALF=half, BLOCK=block,
        num_warps=min(16, max(1, block // 512)))
    return out, new_residual


@triton.jit
def _all_reduce_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, buffers_ptr,
                                flags_ptr, counters_ptr, rows, hidden, eps,
                                RANK: tl.constexpr, WORLD: tl.constexpr, HALF: tl.constexpr,
                                BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    epoch = tl.load(counters_ptr)
    half = (epoch % 2) * HALF
    dtype = x_ptr.dtype.element_ty
    mine = tl.load(buffers_ptr + RANK).to(tl.pointer_type(dtype))
    for row in range(pid, rows, programs):  # publish this program's rows
        x = tl.load(x_ptr + row * hidden + cols, mask=mask)
        tl.store(mine + half + row * hidden + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's rows are written before the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            their_flags = tl.load(flags_ptr + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(their_flags + pid * WORLD + RANK, epoch + 1, sem="release",
                           scope="sys")
    my_flags = tl.load(flags_ptr + RANK).to(tl.pointer_type(tl.int64))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            seen = tl.atomic_add(my_flags + pid * WORLD + peer, 0, sem="acquire", scope="sys")
            while seen < epoch + 1:
                seen = tl.atomic_add(my_flags + pid * WORLD + peer, 0, sem="acquire",
                                     scope="sys")
    tl.debug_barrier()
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, rows, programs):
        acc = tl.zeros([BLOCK], tl.float32)
        for peer in tl.static_range(WORLD):  # rank order: every rank sums alike
            part = tl.load(buffers_ptr + peer).to(tl.pointer_type(dtype))
            acc += tl.load(part + half + row * hidden + cols, mask=mask, other=0.0,
                           volatile=True).to(tl.float32)
        res = tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0)
        h = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(new_res_ptr + row * hidden + cols, h, mask=mask)
        h32 = h.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(h32 * h32, axis=0) / hidden + eps)
        normed = (h32 * inv_rms).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, (w * normed).to(dtype), mask=mask)
    # the last program out advances the epoch for the next call (a later launch sees it)
    done = tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == programs - 1:
        tl.store(counters_ptr + 1, 0)
        tl.store(counters_ptr, epoch + 1)

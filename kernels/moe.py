"""Mixture-of-experts MLP: each token's hidden state goes through its top-k experts' gated
SiLU MLPs, and the outputs are summed with the routing weights.

Routing (`select_experts`): softmax over all experts in float32, the top k, optionally
renormalised and rounded; one Triton launch on the GPU. The GPU path then sorts the token
slots (token t's j-th expert is slot t * k + j) by expert, each expert's list padded to a
whole block of BLOCK_M rows (`moe_align`: one Triton program up to 2048 slots), then two
grouped GEMMs run over those blocks: gate/up with SiLU-and-mul fused (w13 [E, 2I, H] -> [slots,
I]) and down (w2 [E, H, I]) times the routing weight; a sum over the k slots of each token
ends it. A block reads only its own expert's weights, so a decode step reads just the
experts its tokens picked.

Everything is sized by the worst case, never by the routing: the sorted list holds
slots + min(slots, E) * (BLOCK_M - 1) rows, the launch grid covers all of them, and
programs past the real rows (read on the device) return at once. No host sync, so a step
replays in a CUDA graph.

fp8 experts (`ExpertScales`): w13 and w2 in e4m3 with per-output-channel or 128 x 128 block
scales; each GEMM's input is quantized first (per token, per 1 x 128 group with blocks, or
by a static per-tensor scale) through kernels/quant.py, and the grouped GEMMs multiply
fp8 by fp8 in float32, applying per-channel scales in the epilogue and block scales per K
tile. The torch twin dequantizes the same fp8 values and multiplies in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import overlap_previous, pdl_launch
from kernels.quant import (FP8_DTYPE, dequantize, quantize_per_token, quantize_static)


@dataclass(frozen=True, slots=True)
class MoEBlocks:
    """Tile sizes of the grouped GEMMs; block_m is also the align step's padding."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, slots=True)
class ExpertScales:
    """fp8 experts' scales: w13 [E, ceil(2I / block_n), ceil(H / group_k)] and w2
    [E, ceil(H / block_n), ceil(I / group_k)] (gate rows' blocks, then up rows', as w13's
    rows, so block_n divides I). Per output channel: block_n 1, group_k None (one group:
    all of K), activations per token; blocks: block_n = group_k = 128, activations per
    1 x group_k group. input_scales: static per-tensor scales of (x, the down projection's
    input) instead."""
    w13: torch.Tensor
    w2: torch.Tensor
    block_n: int = 1
    group_k: int | None = None
    input_scales: tuple[torch.Tensor, torch.Tensor] | None = None


def quantize_input(a: torch.Tensor, scales: ExpertScales, which: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's input (which: 0 for x, 1 for the down projection's) in fp8 and its
    float32 scales [rows, groups]; a static scale comes back as a stride-0 column."""
    if scales.input_scales is None:
        return quantize_per_token(a, FP8_DTYPE, scales.group_k)
    static = scales.input_scales[which].reshape(1, 1)
    return quantize_static(a, static, FP8_DTYPE), static.expand(a.shape[0], 1)


def moe_blocks(num_tokens: int, top_k: int, num_experts: int) -> MoEBlocks:
    """Tiles by the rows an expert gets on average: a decode step's few rows per expert
    take the smallest M tile (its padding rows read no more weights), large prefills wide
    ones that reuse each weight tile over more rows. Not yet swept: on the H100 a
    Qwen3-30B-A3B layer takes 1.99x its experts' bytes at one token, 1.04x at eight
    (benchmarks/issue29-h100)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:  # narrow N tiles: a few experts' weights over every SM
        return MoEBlocks(16, 32, 128, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return MoEBlocks(32, 64, 64, num_warps=4, num_stages=4)
    return MoEBlocks(64, 128, 64, num_warps=8, num_stages=3)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] -> float32 weights and int64 expert ids, both [T, k], best first: softmax over
    all experts in float32, the top k, divided by their sum when `renormalize`, rounded to
    the logits' dtype when `round_weights` (Qwen MoE does; Mixtral keeps float32). The one
    dispatch point for this op: CUDA tensors take the Triton kernel (one launch where the
    torch ops take up to six, which a decode step would feel)."""
    if router_logits.is_cuda:
        return select_experts_triton(router_logits, top_k, renormalize, round_weights)
    return select_experts_ref(router_logits, top_k, renormalize, round_weights)


def select_experts_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_weights:
        weights = weights.to(router_logits.dtype).float()
    return weights, ids


def select_experts_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                          round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens:
        _select_experts_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            RENORMALIZE=renormalize, ROUND=round_weights,
            EXPERTS=triton.next_power_of_2(num_experts), num_warps=1,
            **pdl_launch(router_logits))
    return weights, ids


@triton.jit
def _select_experts_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride,
                           TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                           ROUND: tl.constexpr, EXPERTS: tl.constexpr, PDL: tl.constexpr):
    """One token per program: the softmax, then k rounds of taking the largest left."""
    overlap_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS)
    live = experts < num_experts
    logits = tl.load(logits_ptr + token * stride + experts, mask=live,
                     other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    left = tl.where(live, probs, -1.0)
    picks = tl.arange(0, TOP_K)
    chosen = tl.zeros((TOP_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((TOP_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        # the lowest index among equals, as torch.topk picks on CPU
        best_id = tl.min(tl.where(left == best, experts, EXPERTS), axis=0)
        chosen = tl.where(picks == j, best, chosen)
        chosen_ids = tl.where(picks == j, best_id.to(tl.int64), chosen_ids)
        left = tl.where(experts == best_id, -1.0, left)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    if ROUND:
        chosen = chosen.to(logits_ptr.dtype.element_ty).to(tl.float32)
    tl.store(weights_ptr + token * TOP_K + picks, chosen)
    tl.store(ids_ptr + token * TOP_K + picks, chosen_ids)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              experts_read: torch.Tensor | None = None,
              scales: ExpertScales | None = None, sum_slots: bool = True) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_weights
    float32 [T, k], topk_ids [T, k] -> [T, H]: sum_j w_j * down_e(silu(gate_e x) * up_e x)
    with e = topk_ids[t, j]. experts_read: an int64 [1] counter that gains the number of
    distinct experts this call reads (on the device: benchmarks read it after a run).
    scales: w13 and w2 are fp8 with these scales. sum_slots=False: the k weighted terms
    [T, k, H] unsummed, for the RMSNorm after the layer to add up (kernels/norm.py) and
    save the sum's launch. The one dispatch point for this op: CUDA tensors take the
    Triton kernels."""
    if x.is_cuda:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, experts_read,
                                scales=scales, sum_slots=sum_slots)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, experts_read, scales, sum_slots)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  experts_read: torch.Tensor | None = None,
                  scales: ExpertScales | None = None, sum_slots: bool = True
                  ) -> torch.Tensor:
    """Expert by expert over the tokens that picked it, roundings as transformers' experts
    make them: each projection's output in x's dtype, the weighted output too."""
    intermediate = w2.shape[2]
    out = torch.zeros_like(x) if sum_slots else x.new_zeros(*topk_ids.shape, x.shape[1])
    experts = topk_ids.unique().tolist()
    if experts_read is not None:
        experts_read += len(experts)
    for expert in experts:
        tokens, which = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = expert_matmul_ref(x[tokens], w13, expert, scales, 0).split(intermediate,
                                                                           dim=-1)
        y = expert_matmul_ref(torch.nn.functional.silu(gate) * up, w2, expert, scales, 1)
        weighted = (y.float() * topk_weights[tokens, which, None]).to(x.dtype)
        if sum_slots:
            out.index_add_(0, tokens, weighted)
        else:
            out[tokens, which] = weighted
    return out


def expert_matmul_ref(a: torch.Tensor, w: torch.Tensor, expert: int,
                      scales: ExpertScales | None, which: int) -> torch.Tensor:
    """a times expert's w^T in a's dtype; fp8 experts (which: 0 for w13, 1 for w2)
    multiply a's quantized values by w's, both dequantized to float32. Quantizing a's rows
    apart from the other experts' rows is the same: each row (or group) has its scale."""
    if scales is None:
        return a @ w[expert].T
    q, a_scale = quantize_input(a, scales, which)
    group = scales.group_k or a.shape[1]
    w_scale = (scales.w13, scales.w2)[which][expert]
    product = dequantize(q, a_scale, 1, group) @ dequantize(w[expert], w_scale,
                                                            scales.block_n, group).T
    return product.to(a.dtype)


@dataclass(frozen=True, slots=True)
class Alignment:
    """Token slots grouped by expert. sorted_slots [rows]: slot ids, each expert's run
    padded with `num_slots` to a multiple of block_m; block_expert [rows / block_m]: the
    expert of each block (E past the end); num_rows [1]: the real (padded) row count."""
    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    num_rows: torch.Tensor


def max_aligned_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """At most min(slots, E) experts have a run, each wasting under a block."""
    rows = num_slots + min(num_slots, num_experts) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


# up to this many slots, CUDA aligns in one Triton program (a decode step's align is one
# launch instead of a dozen torch ops); above, the torch ops' parallel sort wins
MAX_KERNEL_ALIGN_SLOTS = 2048
ALIGN_CHUNK = 32  # slots per step of that program: [chunk, experts] comparisons at a time


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              experts_read: torch.Tensor | None = None) -> Alignment:
    """Sorts the slots of topk_ids [T, k] by expert, in slot order within an expert, each
    expert's run padded to a multiple of block_m; adds the number of experts with a run
    to `experts_read`. The one dispatch point for this op."""
    if topk_ids.is_cuda and topk_ids.numel() <= MAX_KERNEL_ALIGN_SLOTS:
        return moe_align_triton(topk_ids, num_experts, block_m, experts_read)
    return moe_align_ref(topk_ids, num_experts, block_m, experts_read)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  experts_read: torch.Tensor | None = None) -> Alignment:
    """Torch ops whose shapes depend on T, k, E and block_m alone: no host sync, so this
    twin serves CUDA graphs of large steps too."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    if experts_read is not None:
        experts_read += (counts > 0).sum()
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    experts_in_order = flat[order]
    # a slot's rank within its expert's run, then its row in the padded list
    run_start = counts.cumsum(0) - counts
    rank = torch.arange(num_slots, device=device) - run_start[experts_in_order]
    rows = padded_end[experts_in_order] - padded[experts_in_order] + rank
    total = max_aligned_rows(num_slots, num_experts, block_m)
    sorted_slots = torch.full((total,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, rows, order.to(torch.int32))
    block_starts = torch.arange(0, total, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return Alignment(sorted_slots, block_expert, padded_end[-1:].to(torch.int32))


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     experts_read: torch.Tensor | None = None) -> Alignment:
    ids = topk_ids.reshape(-1).contiguous()
    device = ids.device
    total = max_aligned_rows(ids.numel(), num_experts, block_m)
    align = Alignment(torch.empty(total, dtype=torch.int32, device=device),
                      torch.empty(total // block_m, dtype=torch.int32, device=device),
                      torch.empty(1, dtype=torch.int32, device=device))
    _align_kernel[(1,)](ids, align.sorted_slots, align.block_expert, align.num_rows,
                        experts_read, ids.numel(), num_experts, total,
                        COUNT=experts_read is not None, BLOCK_M=block_m,
                        EXPERTS=max(16, triton.next_power_of_2(num_experts)),
                        CHUNK=ALIGN_CHUNK, num_warps=4)
    return align


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, experts_read_ptr,
                  num_slots, num_experts, total_rows, COUNT: tl.constexpr,
                  BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    """One program: count each expert's slots, lay the padded runs out, then place the
    slots chunk by chunk (a slot's rank: the earlier slots of its chunk on its expert,
    plus the run's rows already taken)."""
    experts = tl.arange(0, EXPERTS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, num_slots, CHUNK):
        ids = tl.load(ids_ptr + start + lanes, mask=start + lanes < num_slots, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    if COUNT:
        tl.atomic_add(experts_read_ptr, tl.sum((counts > 0).to(tl.int64), axis=0))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    for start in range(0, total_rows, CHUNK):
        rows = start + lanes
        tl.store(sorted_ptr + rows, tl.zeros((CHUNK,), dtype=tl.int32) + num_slots,
                 mask=rows < total_rows)
    num_blocks = total_rows // BLOCK_M
    for start in range(0, num_blocks, CHUNK):
        blocks = start + lanes
        # the block's expert: how many runs end at or before its first row
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, num_experts),
                 mask=blocks < num_blocks)
    tl.debug_barrier()  # the padding is written before any slot takes its row
    next_row = ends - padded
    for start in range(0, num_slots, CHUNK):
        slots = start + lanes
        ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1)
        hit = ids[:, None] == experts[None, :]
        earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])
        row = (tl.sum(tl.where(hit, next_row[None, :], 0), axis=1)
               + tl.sum(earlier.to(tl.int32), axis=1))
        tl.store(sorted_ptr + row, slots, mask=slots < num_slots)
        next_row += tl.sum(hit.to(tl.int32), axis=0)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     experts_read: torch.Tensor | None = None,
                     blocks: MoEBlocks | None = None,
                     scales: ExpertScales | None = None, sum_slots: bool = True
                     ) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, intermediate = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, 2 * intermediate, hidden)
    assert x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    # the up rows' scales start a block after the gate rows' (ExpertScales)
    assert scales is None or intermediate % scales.block_n == 0
    if num_tokens == 0:
        return x.new_zeros(0, hidden) if sum_slots else x.new_zeros(0, top_k, hidden)
    num_slots = num_tokens * top_k
    if scales is None and blocks is None and num_slots <= GEMV_MAX_SLOTS:
        return fused_moe_gemv(x, w13, w2, topk_weights, topk_ids, experts_read,
                              sum_slots=sum_slots)
    blocks = blocks or moe_blocks(num_tokens, top_k, num_experts)
    act = torch.empty(num_slots, intermediate, dtype=x.dtype, device=x.device)
    down = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    align = moe_align(topk_ids, num_experts, blocks.block_m, experts_read)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(x, w13, act, align, weights, top_k, intermediate, blocks, gated=True,
                  scales=scales)
    _grouped_gemm(act, w2, down, align, weights, 1, hidden, blocks, gated=False,
                  scales=scales)
    return summed(down.view(num_tokens, top_k, hidden), sum_slots)


def summed(slots: torch.Tensor, sum_slots: bool) -> torch.Tensor:
    """[T, k, H] slots, summed over k (torch sums bf16 in float32 and rounds once) or not."""
    return slots.sum(1) if sum_slots else slots


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: Alignment,
                  weights: torch.Tensor, rows_per_a: int, n: int, blocks: MoEBlocks,
                  gated: bool, scales: ExpertScales | None = None) -> None:
    """out[slot, :n] for every slot in align.sorted_slots, from a's row slot // rows_per_a
    and the slot's expert's w [E, n (x2 when gated), K]; with scales, a is quantized
    here and w is fp8."""
    k = w.shape[2]
    grid = (align.sorted_slots.numel() // blocks.block_m, triton.cdiv(n, blocks.block_n))
    # float32 models keep full precision (their tests hold them to 1e-4): no TF32
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    # unquantized: the scale pointers are never read
    quant, a_in, a_scale, w_scale, group_k, block_n = 0, a, weights, weights, k, 1
    scale_strides = (0, 0, 0)
    if scales is not None:
        a_in, a_scale = quantize_input(a, scales, 0 if gated else 1)
        w_scale = (scales.w13 if gated else scales.w2).float().contiguous()
        group_k, block_n = min(scales.group_k or k, k), scales.block_n
        # per output channel: scales once in the epilogue; blocks: per K tile
        quant = 2 if group_k < k else 1
        assert quant == 1 or group_k % blocks.block_k == 0, "a group is whole K tiles"
        scale_strides = (a_scale.stride(0), w_scale.stride(0), w_scale.stride(1))
    _moe_gemm_kernel[grid](
        a_in, w, out, align.sorted_slots, align.block_expert, align.num_rows, weights,
        a_scale, w_scale, out.shape[0], n, k, a_in.stride(0), w.stride(0), w.stride(1),
        out.stride(0), *scale_strides, group_k, block_n, ROWS_PER_A=rows_per_a,
        GATED=gated, WEIGHTED=not gated, QUANT=quant, PRECISION=precision,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_slots_ptr, block_expert_ptr,
                     num_rows_ptr, weights_ptr, a_scale_ptr, w_scale_ptr, num_slots, n, k,
                     a_stride, w_stride_e, w_stride_n, out_stride, a_scale_stride,
                     w_scale_stride_e, w_scale_stride_n, group_k, block_n,
                     ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                     QUANT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """QUANT 0: a and w in the activation dtype; 1: fp8 with one scale per row of a and
    per output channel of w (applied to the sums); 2: fp8 with a scale per group_k
    columns of a's rows and per block_n x group_k block of w (applied per K tile)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return  # past the real rows: the grid is sized for the worst case
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = slots < num_slots  # padding rows carry num_slots
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    a_index = (slots // ROWS_PER_A).to(tl.int64)
    a_rows = a_ptr + a_index[:, None] * a_stride
    w_cols = w_ptr + expert * w_stride_e + cols.to(tl.int64)[None, :] * w_stride_n
    # the scales of a's rows, and of the gate (or only) and up output channels' blocks
    a_scales = a_scale_ptr + a_index * a_scale_stride
    w_scales = w_scale_ptr + expert * w_scale_stride_e + (cols // block_n) * w_scale_stride_n
    w_scales_up = w_scale_ptr + expert * w_scale_stride_e + (
        (cols + n) // block_n) * w_scale_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = ks < k - k0
        a = tl.load(a_rows + k0 + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & cols_ok[None, :]
        w = tl.load(w_cols + k0 + ks[:, None], mask=w_mask, other=0.0)
        if QUANT == 2:  # this K tile lies in one scale group
            g = k0 // group_k
            sa = tl.load(a_scales + g, mask=live, other=0.0)[:, None]
            sw = tl.load(w_scales + g, mask=cols_ok, other=0.0)[None, :]
            acc += tl.dot(a, w) * sa * sw
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:  # the up rows sit n rows below the gate rows
            w_up = tl.load(w_cols + n * w_stride_n + k0 + ks[:, None], mask=w_mask, other=0.0)
            if QUANT == 2:
                sw_up = tl.load(w_scales_up + g, mask=cols_ok, other=0.0)[None, :]
                acc_up += tl.dot(a, w_up) * sa * sw_up
            else:
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if QUANT == 1:
        sa = tl.load(a_scales, mask=live, other=0.0)[:, None]
        acc *= sa * tl.load(w_scales, mask=cols_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= sa * tl.load(w_scales_up, mask=cols_ok, other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    # each product rounded to the activation dtype as the reference's matmuls round it
    result = acc.to(dtype).to(tl.float32)
    if GATED:
        silu = (result / (1.0 + tl.exp(-result))).to(dtype).to(tl.float32)
        result = silu * acc_up.to(dtype).to(tl.float32)
    if WEIGHTED:
        result *= tl.load(weights_ptr + slots, mask=live, other=0.0)[:, None]
    tl.store(out_ptr + slots.to(tl.int64)[:, None] * out_stride + cols[None, :],
             result.to(dtype), mask=live[:, None] & cols_ok[None, :])


# Up to this many token slots (a decode step of a token or two under top-8 routing) the
# experts run as GEMVs straight off topk_ids: no align launch, and no tile padded from one
# real row to block_m. Above it the grouped GEMMs reuse each weight tile over several rows.
GEMV_MAX_SLOTS = 16
# (BLOCK_N, BLOCK_K, warps) of the gate/up launch and of the down launch: the best of
# sweeps on the H100 (benchmarks/issue29-h100/moe-decode-tiles.txt; the down launch's short
# K of 768 wants wider stripes) and before it the H200 (moe-decode-h200-sweep.txt)
MoEGemvTiles = tuple[tuple[int, int, int], tuple[int, int, int]]
GEMV_TILES: MoEGemvTiles = ((8, 256, 8), (32, 128, 8))


def fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   experts_read: torch.Tensor | None = None,
                   tiles: MoEGemvTiles = GEMV_TILES, sum_slots: bool = True
                   ) -> torch.Tensor:
    """fused_moe for a few token slots (unquantized experts): one program per (slot, N
    block) reads its slot's expert rows directly; roundings as the grouped GEMMs make them,
    the k slots' weighted outputs summed in float32 and rounded once. (A down kernel that
    also summed each token's k slots ran a third slower on the H200: one program per token
    walks its k experts in turn.)"""
    num_tokens, hidden = x.shape
    intermediate, top_k = w2.shape[2], topk_ids.shape[1]
    num_slots = num_tokens * top_k
    assert x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    act = torch.empty(num_slots, intermediate, dtype=x.dtype, device=x.device)
    (block_n, block_k, warps), down_tiles = tiles
    _moe_gemv_kernel[(num_slots, triton.cdiv(intermediate, block_n))](
        x, w13, act, ids, weights, experts_read, intermediate, hidden, x.stride(0),
        num_slots, ROWS_PER_A=top_k, GATED=True, COUNT=experts_read is not None,
        SLOTS=triton.next_power_of_2(num_slots), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl_launch(x))
    down = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = down_tiles
    _moe_gemv_kernel[(num_slots, triton.cdiv(hidden, block_n))](
        act, w2, down, ids, weights, experts_read, hidden, intermediate, act.stride(0),
        num_slots, ROWS_PER_A=1, GATED=False, COUNT=False,
        SLOTS=triton.next_power_of_2(num_slots), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **pdl_launch(x))
    return summed(down.view(num_tokens, top_k, hidden), sum_slots)


@triton.jit
def _moe_gemv_kernel(a_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, experts_read_ptr, n, k,
                     a_stride, num_slots, ROWS_PER_A: tl.constexpr, GATED: tl.constexpr,
                     COUNT: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[slot, cols] = a[slot // ROWS_PER_A] . w[expert(slot), cols] (GATED: silu(gate)
    * up, the up rows n below the gate rows; else times the slot's routing weight)."""
    overlap_previous(PDL)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    if COUNT:
        if slot == 0 and pid_n == 0:  # the distinct experts of all slots, counted once
            lanes = tl.arange(0, SLOTS)
            all_ids = tl.load(ids_ptr + lanes, mask=lanes < num_slots, other=-1)
            earlier = (all_ids[:, None] == all_ids[None, :]) & (lanes[None, :] < lanes[:, None])
            first = (tl.sum(earlier.to(tl.int32), axis=1) == 0) & (lanes < num_slots)
            tl.atomic_add(experts_read_ptr, tl.sum(first.to(tl.int64), axis=0))
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < n
    ks = tl.arange(0, BLOCK_K)
    a_row = a_ptr + (slot // ROWS_PER_A).to(tl.int64) * a_stride
    w_rows = w_ptr + expert * (2 * n if GATED else n) * k + cols.to(tl.int64)[:, None] * k
    # products summed per lane, reduced once after the loop, and each step's loads of the
    # next tile issued before its own arithmetic (as kernels/gemv.py's one-row path; 4%
    # faster at one token, benchmarks/issue29-h100/moe-decode-tiles.txt)
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    lanes_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_ok = ks < k
    mask = cols_ok[:, None] & k_ok[None, :]
    a = tl.load(a_row + ks, mask=k_ok, other=0.0)
    w = tl.load(w_rows + ks[None, :], mask=mask, other=0.0)
    w_up = w  # a placeholder the loop carries where there are no up rows
    if GATED:
        w_up = tl.load(w_rows + n * k + ks[None, :], mask=mask, other=0.0)
    for k0 in range(0, k, BLOCK_K):
        nk_ok = ks < k - k0 - BLOCK_K
        nmask = cols_ok[:, None] & nk_ok[None, :]
        a_next = tl.load(a_row + k0 + BLOCK_K + ks, mask=nk_ok, other=0.0)
        w_next = tl.load(w_rows + k0 + BLOCK_K + ks[None, :], mask=nmask, other=0.0)
        w_up_next = w_next
        if GATED:
            w_up_next = tl.load(w_rows + n * k + k0 + BLOCK_K + ks[None, :], mask=nmask,
                                other=0.0)
        af = a.to(tl.float32)[None, :]
        lanes += w.to(tl.float32) * af
        if GATED:
            lanes_up += w_up.to(tl.float32) * af
        a, w, w_up = a_next, w_next, w_up_next
    acc = tl.sum(lanes, axis=1)
    acc_up = tl.sum(lanes_up, axis=1)
    dtype = out_ptr.dtype.element_ty
    result = acc.to(dtype).to(tl.float32)
    if GATED:
        silu = (result / (1.0 + tl.exp(-result))).to(dtype).to(tl.float32)
        result = silu * acc_up.to(dtype).to(tl.float32)
    else:
        result *= tl.load(weights_ptr + slot)
    tl.store(out_ptr + slot.to(tl.int64) * n + cols, result.to(dtype), mask=cols_ok)

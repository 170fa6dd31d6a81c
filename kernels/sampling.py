"""Temperature sampling in one pass over the logits (the Gumbel-max trick).

argmax(logits / T + g), g = -log(-log(u)) with u uniform, is a draw from softmax(logits / T).
The torch sampler spends ~1 ms of a 256-row decode step on it (divide, softmax, noise,
clamp, divide, argmax: ten passes over [rows, vocab] floats); the kernel reads the logits
once and makes its uniforms on the fly from Triton's Philox generator, keyed by
(seed, row * vocab + column), so the result depends on the seed and the logits alone.
`philox_uniform` writes the same uniforms out, which is what the torch twin consumes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_VOCAB = 2048  # columns per iteration; one program walks one row


def gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, seed: int
                         ) -> torch.Tensor:
    """logits [rows, vocab] (any float dtype), temperature float32 [rows] (> 0) -> int64
    token ids [rows]."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and rows * vocab < 2 ** 31  # Philox offsets are int32
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), temperature, out, seed, vocab,
                                   BLOCK=BLOCK_VOCAB, num_warps=8)
    return out


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
                      ) -> torch.Tensor:
    """The twin, given the kernel's uniforms (philox_uniform with the same seed); the same
    arithmetic in the same order, so the two agree token for token."""
    scaled = logits.float() * (1.0 / temperature.float())[:, None]
    return (scaled - torch.log(-torch.log(uniform))).argmax(dim=-1)


def philox_uniform(rows: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    """float32 [rows, vocab]: the uniforms gumbel_argmax_triton draws for this seed."""
    out = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    _philox_uniform_kernel[(rows, triton.cdiv(vocab, BLOCK_VOCAB))](
        out, seed, vocab, BLOCK=BLOCK_VOCAB)
    return out


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, temperature_ptr, out_ptr, seed, vocab,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inv_t = 1.0 / tl.load(temperature_ptr + row)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=0.0)
        u = tl.rand(seed, row * vocab + cols)
        score = x.to(tl.float32) * inv_t - tl.log(-tl.log(u))
        score = tl.where(mask, score, float("-inf"))
        take = score > best  # strict: each lane keeps its first maximum
        best = tl.where(take, score, best)
        best_col = tl.where(take, cols, best_col)
    top = tl.max(best, axis=0)
    # the first column holding the maximum, as torch.argmax picks
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_col, vocab), axis=0).to(tl.int64))


@triton.jit
def _philox_uniform_kernel(out_ptr, seed, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    tl.store(out_ptr + row * vocab + cols, tl.rand(seed, row * vocab + cols), mask=mask)


# --- top-p without sorting the vocabulary ---------------------------------------------------

ONE_BITS = 0x3F800000  # 1.0's float32 bit pattern; a probability's pattern lies in [0, it]
TOP_P_STEPS = 30  # ONE_BITS < 2**30: thirty halvings of [0, ONE_BITS] leave one pattern
BLOCK_TOP_P = 4096


def top_p_threshold_triton(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs float32 [rows, vocab] (each row summing to about 1), top_p float32 [rows] in
    (0, 1] -> float32 [rows]: each row's top-p set is its probabilities >= the threshold
    (0 where top_p is 1). See top_p_threshold_ref."""
    rows, vocab = probs.shape
    assert probs.dtype == torch.float32 and probs.stride(1) == 1
    out = torch.empty(rows, dtype=torch.float32, device=probs.device)
    _top_p_threshold_kernel[(rows,)](probs, probs.stride(0), top_p, out, vocab,
                                     ONE=ONE_BITS, STEPS=TOP_P_STEPS, BLOCK=BLOCK_TOP_P,
                                     num_warps=8)
    return out


def top_p_threshold_ref(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The twin: a token is in its row's top-p set when the mass of the tokens strictly
    more likely than it is below top_p, which is what a full sort and a cumulative sum
    find. That mass only falls as the probability rises, and a non-negative float's bit
    pattern orders as its value, so a binary search over the patterns finds the smallest
    threshold whose mass above is below top_p: fixed steps, fixed shapes, no host sync."""
    rows = probs.shape[0]
    lo = torch.zeros(rows, dtype=torch.int32, device=probs.device)
    hi = torch.full((rows,), ONE_BITS, dtype=torch.int32, device=probs.device)
    for _ in range(TOP_P_STEPS):
        mid = lo + (hi - lo) // 2
        pivot = mid.view(torch.float32).unsqueeze(1)
        below = torch.where(probs > pivot, probs, 0.0).sum(dim=-1) < top_p
        hi = torch.where(below, mid, hi)
        lo = torch.where(below, lo, mid + 1)
    # Rounding can leave a row's mass short of 1.0, so top_p=1 is not left to the search.
    return torch.where(top_p < 1.0, hi.view(torch.float32), 0.0)


@triton.jit
def _top_p_threshold_kernel(probs_ptr, stride_row, top_p_ptr, out_ptr, vocab,
                            ONE: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    # ONE comes in as an argument: a compiled kernel may read no plain global (the
    # interpreter allows it, so only a compile for the GPU shows that)
    row = tl.program_id(0)
    top_p = tl.load(top_p_ptr + row)
    lo = tl.zeros([1], tl.int32)
    hi = tl.full([1], ONE, tl.int32)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        pivot = mid.to(tl.float32, bitcast=True)
        mass = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(probs_ptr + row * stride_row + cols, mask=cols < vocab, other=0.0)
            mass += tl.where(x > pivot, x, 0.0)
        below = tl.sum(mass, axis=0) < top_p
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid + 1)
    threshold = tl.where(top_p < 1.0, hi.to(tl.float32, bitcast=True), 0.0)
    tl.store(out_ptr + row + tl.arange(0, 1), threshold)

"""Choosing tokens on the GPU: greedy and temperature sampling in one pass over the logits,
and the logprobs a step asks for.

Temperature sampling uses the Gumbel-max trick: argmax(logits / T + g), g = -log(-log(u))
with u uniform, is a draw from softmax(logits / T). The torch sampler spends ~1 ms of a
256-row decode step on it (divide, softmax, noise, clamp, divide, argmax: ten passes over
[rows, vocab] floats); the kernel reads the logits once and makes its uniforms on the fly
from Triton's Philox generator, keyed by (seed, row * vocab + column), so the result
depends on the seed and the logits alone. `philox_uniform` writes the same uniforms out,
which is what the torch twin consumes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import overlap_previous, pdl_launch

# Columns per program of the argmax's first launch. One program a row walked Llama-3's
# 128,256 columns in dependent loads, and torch's argmax reduces a row of that width in one
# block: 38 us of an 8B batch-1 decode step on an H200, against 8.5 us for its 19 blocks
# at Qwen3's 151,936 (benchmarks/issue30-h100/s10).
ARGMAX_CHUNK = 4096


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: each row's first maximum, as torch.argmax picks (a NaN counts as
    +inf here); on CUDA from argmax_triton."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1:
        return argmax_triton(logits)
    return logits.argmax(dim=-1)


def gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, seed: int
                         ) -> torch.Tensor:
    """logits [rows, vocab] (any float dtype), temperature float32 [rows] (> 0) -> int64
    token ids [rows]."""
    assert logits.shape[0] * logits.shape[1] < 2 ** 31  # Philox offsets are int32
    return argmax_triton(logits, temperature, seed)


def argmax_triton(logits: torch.Tensor, temperature: torch.Tensor | None = None,
                  seed: int = 0) -> torch.Tensor:
    """int64 [rows]: the first column of each row's largest logit (temperature None), or
    of logits / T + Gumbel noise drawn from `seed` (the sampled token). Two launches: every
    ARGMAX_CHUNK columns of a row a program, its maximum and that maximum's first column;
    then a program a row takes the first chunk holding the row's maximum."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    chunks = triton.cdiv(vocab, ARGMAX_CHUNK)
    device = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    maxima = torch.empty((rows, chunks), dtype=torch.float32, device=device)
    columns = torch.empty((rows, chunks), dtype=torch.int32, device=device)
    gumbel = temperature is not None
    _chunk_argmax_kernel[(rows, chunks)](
        logits, logits.stride(0), temperature if gumbel else logits, maxima, columns, seed,
        vocab, GUMBEL=gumbel, BLOCK=ARGMAX_CHUNK, num_warps=4, **pdl_launch(logits))
    _argmax_combine_kernel[(rows,)](maxima, columns, out, chunks,
                                    CHUNKS=triton.next_power_of_2(chunks), num_warps=1,
                                    **pdl_launch(logits))
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
    _philox_uniform_kernel[(rows, triton.cdiv(vocab, ARGMAX_CHUNK))](
        out, seed, vocab, BLOCK=ARGMAX_CHUNK)
    return out


# A row of top_logprobs_triton's first pass is split into chunks of this many columns, a
# program each, and a second launch combines them: one program a row walked Qwen3's
# 151,936 columns in 75 dependent loads, tens of microseconds on one SM, which was most of
# what logprobs cost a batch-1 step (issue 31).
LOGPROBS_CHUNK = 4096
# Past this many top logprobs a row, the sampler asks torch (log_softmax, topk): each one
# more is two more reductions over every chunk here (vLLM's --max-logprobs is 20).
MAX_KERNEL_LOGPROBS = 32


def top_logprobs_triton(logits: torch.Tensor, k: int, chosen: torch.Tensor | None = None,
                        tile: tuple[int, int] = (LOGPROBS_CHUNK, 4)) -> torch.Tensor:
    """A row's chosen token, its logprob and rank, and the row's k likeliest tokens with
    their logprobs: int64 [rows * (2 * k + 4)], the layout SamplerOutput.packed sends to
    the host in one copy (packed_logprobs): each row's token (`chosen`, int64 [rows], or
    where it is None, as greedy picks, the row's first maximum), then ids [rows, k + 1]
    (that token, then the likeliest k, the lower column first among equal logits), their
    logprobs' float32 bits [rows, k + 1] (sign-extended), and ranks [rows] (1 + the
    columns of a strictly larger logit). torch's log_softmax, gather, topk and comparison
    took about 0.7 ms of a 256-row step over Qwen3's columns, six passes and as many
    launches, and as much host time again (issue 31).

    Three launches: every chunk of a row its maximum, exp-sum and count above the chosen
    token; then the largest logits of only the row's k chunks of largest maxima (the
    lower chunk first among equal ones), since a logit of any other chunk has k larger
    ones, or as large and in lower columns, from those chunks' maxima, and of those only
    the ones at or above the least of the k maxima (_chunk_tops_kernel); then the row's
    logsumexp, rank and k likeliest from those. Taking the k largest is 2k reductions
    over a chunk: over every chunk, they took 177 of a 256-row step's us at k = 5 and 752
    at k = 20; over the k picked ones 54 and 443; as many as are at or above that floor,
    42.5 and 92.3 (benchmarks/gpu/top_logprobs_chunks.py, benchmarks/issue31-h200/busy14
    and busy15). tile: the chunk of columns (a power of two) and the first launch's
    warps."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and 1 <= k <= min(vocab, MAX_KERNEL_LOGPROBS)
    chunk, warps = tile
    chunks = triton.cdiv(vocab, chunk)
    picked = min(k, chunks)
    device = logits.device
    maxima = torch.empty((rows, chunks, 2), dtype=torch.float32, device=device)
    beaten = torch.empty((rows, chunks), dtype=torch.int32, device=device)
    tops = torch.empty((rows, picked, k), dtype=torch.float32, device=device)
    columns = torch.empty((rows, picked, k), dtype=torch.int32, device=device)
    out = torch.empty(rows * (2 * k + 4), dtype=torch.int64, device=device)
    chosen_ptr = out if chosen is None else chosen  # unread without a chosen token
    chunks_pad = triton.next_power_of_2(chunks)
    _chunk_sums_kernel[(rows, chunks)](logits, logits.stride(0), chosen_ptr, maxima, beaten,
                                       vocab, CHOSEN=chosen is not None, BLOCK=chunk,
                                       num_warps=warps)
    k_slots = triton.next_power_of_2(k)
    _chunk_tops_kernel[(rows, picked)](logits, logits.stride(0), maxima, tops, columns,
                                       vocab, chunks, K=k, BLOCK=chunk, CHUNKS=chunks_pad,
                                       K_SLOTS=k_slots, num_warps=4)
    picked_pad = triton.next_power_of_2(picked)
    _top_combine_kernel[(rows,)](logits, logits.stride(0), chosen_ptr, maxima, beaten, tops,
                                 columns, out, vocab, chunks, picked,
                                 CHOSEN=chosen is not None, K=k, CHUNKS=chunks_pad,
                                 PICKED=picked_pad, K_SLOTS=k_slots,
                                 num_warps=1 if picked_pad * k_slots <= 256 else 4)
    return out


def top_logprobs_ref(logits: torch.Tensor, k: int, chosen: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The twin: log_softmax in float32, the chosen token's entry (the first maximum where
    none is given, as torch.argmax picks), the k likeliest from a stable sort (the lower
    column first among equal logits, as the kernel takes them; topk's order among equals
    is its own), packed the same way."""
    x = logits.float()
    logprobs = torch.log_softmax(x, dim=-1)
    token = x.argmax(dim=-1, keepdim=True) if chosen is None else chosen.long()[:, None]
    ranks = (x > x.gather(1, token)).sum(dim=-1) + 1
    top = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    return packed_logprobs(token.flatten(), torch.cat([token, top], dim=1),
                           logprobs.gather(1, torch.cat([token, top], dim=1)), ranks)


def packed_logprobs(tokens: torch.Tensor, ids: torch.Tensor, values: torch.Tensor,
                    ranks: torch.Tensor) -> torch.Tensor:
    """int64: the tokens [N], then ids [R, w], their logprobs' float32 bits [R, w]
    (sign-extended) and ranks [R], as top_logprobs_triton writes them: the layout that
    SamplerOutput.packed sends to the host in one copy."""
    return torch.cat([tokens, ids.flatten(), values.view(torch.int32).long().flatten(), ranks])


@triton.jit
def _chunk_sums_kernel(logits_ptr, stride_row, chosen_ptr, maxima_ptr, beaten_ptr, vocab,
                       CHOSEN: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of a row: its maximum, the sum of exp(x - maximum) (-inf columns, which
    a grammar mask leaves, add nothing), and how many of its columns beat the chosen
    token's logit."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride_row
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    total = tl.sum(tl.where(x > float("-inf"), tl.exp(x - top), 0.0), axis=0)
    at = row * tl.num_programs(1) + part
    tl.store(maxima_ptr + 2 * at, top)
    tl.store(maxima_ptr + 2 * at + 1, total)
    if CHOSEN:
        chosen = tl.load(base + tl.load(chosen_ptr + row)).to(tl.float32)
        tl.store(beaten_ptr + at, tl.sum((x > chosen).to(tl.int32), axis=0))


@triton.jit
def _chunk_tops_kernel(logits_ptr, stride_row, maxima_ptr, tops_ptr, columns_ptr, vocab,
                       chunks, K: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                       K_SLOTS: tl.constexpr):
    """The row's chunk of the j-th largest maximum (the lower chunk first among equal
    ones), j the program's: its largest logits with their columns, each the lowest column
    of its value not taken yet, up to K of them, of those at least the picked chunks'
    least maximum where K chunks are picked; -inf and `vocab` fill the slots left. The
    row's k-th largest logit is then at least that maximum (k chunks have one as large),
    so nothing below it is among the k likeliest, and most chunks hold only a few logits
    above it: at K = 20 the K reductions over every picked chunk took 443 us of a
    256-row step."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    picked = tl.num_programs(1)
    part = tl.arange(0, CHUNKS)
    valid = part < chunks
    maxima = tl.load(maxima_ptr + 2 * (row * chunks + part), mask=valid,
                     other=float("-inf"))
    # a chunk's place: the chunks of a larger maximum, or as large and below it
    ahead = (maxima[None, :] > maxima[:, None]) | \
        ((maxima[None, :] == maxima[:, None]) & (part[None, :] < part[:, None]))
    place = tl.sum(ahead.to(tl.int32), axis=1)
    chunk = tl.min(tl.where((place == j) & valid, part, CHUNKS), axis=0)
    floor = tl.max(tl.where((place == picked - 1) & valid, maxima, float("-inf")), axis=0)
    floor = tl.where(picked == K, floor, float("-inf"))  # fewer chunks than K: no floor
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    taken = cols >= vocab
    held = tl.minimum(tl.sum(((x >= floor) & ~taken).to(tl.int32), axis=0), K)
    at = (row * picked + j) * K
    slots = tl.arange(0, K_SLOTS)
    left = (slots >= held) & (slots < K)
    tl.store(tops_ptr + at + slots, float("-inf"), mask=left)
    tl.store(columns_ptr + at + slots, vocab, mask=left)
    for i in range(held):
        best = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        col = tl.min(tl.where(~taken & (x == best), cols, vocab), axis=0)
        tl.store(tops_ptr + at + i, best)
        tl.store(columns_ptr + at + i, col)
        taken = taken | (cols == col)


@triton.jit
def _top_combine_kernel(logits_ptr, stride_row, chosen_ptr, maxima_ptr, beaten_ptr, tops_ptr,
                        columns_ptr, out_ptr, vocab, chunks, picked, CHOSEN: tl.constexpr,
                        K: tl.constexpr, CHUNKS: tl.constexpr, PICKED: tl.constexpr,
                        K_SLOTS: tl.constexpr):
    """A row's chunks into its logsumexp, rank and K likeliest (the picked chunks'
    candidates, taken largest first, the lower column first among equals), written in
    place in the packed layout."""
    row = tl.program_id(0)
    rows = tl.num_programs(0)
    part = tl.arange(0, CHUNKS)
    valid = part < chunks
    at = row * chunks + part
    maxima = tl.load(maxima_ptr + 2 * at, mask=valid, other=float("-inf"))
    totals = tl.load(maxima_ptr + 2 * at + 1, mask=valid, other=0.0)
    top = tl.max(maxima, axis=0)
    total = tl.sum(tl.where(maxima > float("-inf"), totals * tl.exp(maxima - top), 0.0), axis=0)
    lse = top + tl.log(total)
    slot = tl.arange(0, PICKED * K_SLOTS)
    part_of, j_of = slot // K_SLOTS, slot % K_SLOTS
    held = (part_of < picked) & (j_of < K)
    candidate = (row * picked + part_of) * K + j_of
    values = tl.load(tops_ptr + candidate, mask=held, other=float("-inf"))
    cols = tl.load(columns_ptr + candidate, mask=held, other=vocab)
    taken = cols >= vocab
    width = K + 1
    ids_at = rows + row * width
    values_at = rows + rows * width + row * width
    first = tl.min(tl.where(~taken & (values == top), cols, vocab), axis=0)
    for j in tl.static_range(K):
        best = tl.max(tl.where(taken, float("-inf"), values), axis=0)
        col = tl.min(tl.where(~taken & (values == best), cols, vocab), axis=0)
        tl.store(out_ptr + ids_at + 1 + j, col.to(tl.int64))
        tl.store(out_ptr + values_at + 1 + j,
                 (best - lse).to(tl.int32, bitcast=True).to(tl.int64))
        taken = taken | (cols == col)
    if CHOSEN:
        token = tl.load(chosen_ptr + row)
        chosen = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
        rank = tl.sum(tl.load(beaten_ptr + at, mask=valid, other=0), axis=0) + 1
    else:
        token = first.to(tl.int64)
        chosen = top
        rank = tl.full([], 1, tl.int32)  # nothing beats a first maximum
    tl.store(out_ptr + row, token)
    tl.store(out_ptr + ids_at, token)
    tl.store(out_ptr + values_at, (chosen - lse).to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(out_ptr + rows + 2 * rows * width + row, rank.to(tl.int64))


@triton.jit
def _chunk_argmax_kernel(logits_ptr, stride_row, temperature_ptr, maxima_ptr, columns_ptr, seed,
                         vocab, GUMBEL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One chunk of a row: its largest score and the first column holding it."""
    overlap_previous(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=mask,
                other=float("-inf")).to(tl.float32)
    if GUMBEL:
        u = tl.rand(seed, row * vocab + cols)
        x = x * (1.0 / tl.load(temperature_ptr + row)) - tl.log(-tl.log(u))
    x = tl.where(x != x, float("inf"), x)
    top = tl.max(x, axis=0)
    at = row * tl.num_programs(1) + part
    tl.store(maxima_ptr + at, top)
    tl.store(columns_ptr + at, tl.min(tl.where(mask & (x == top), cols, vocab), axis=0))


@triton.jit
def _argmax_combine_kernel(maxima_ptr, columns_ptr, out_ptr, chunks, CHUNKS: tl.constexpr,
                           PDL: tl.constexpr):
    """A row's chunks: the first column of the largest maximum (chunks hold ascending
    columns, so the least column among the chunks that hold it)."""
    overlap_previous(PDL)
    row = tl.program_id(0)
    part = tl.arange(0, CHUNKS)
    valid = part < chunks
    maxima = tl.load(maxima_ptr + row * chunks + part, mask=valid, other=float("-inf"))
    columns = tl.load(columns_ptr + row * chunks + part, mask=valid, other=2 ** 31 - 1)
    top = tl.max(maxima, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(maxima == top, columns, 2 ** 31 - 1),
                                   axis=0).to(tl.int64))


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
    return _pattern_search(probs, probs, top_p, top_p)


def _pattern_search(probs: torch.Tensor, mass: torch.Tensor, limit: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """The smallest pattern t for which the `mass` of the tokens with probs > t, summed in
    mass's dtype, is below `limit`; 0 where top_p is 1."""
    rows = probs.shape[0]
    lo = torch.zeros(rows, dtype=torch.int32, device=probs.device)
    hi = torch.full((rows,), ONE_BITS, dtype=torch.int32, device=probs.device)
    for _ in range(TOP_P_STEPS):
        mid = lo + (hi - lo) // 2
        pivot = mid.view(torch.float32).unsqueeze(1)
        below = torch.where(probs > pivot, mass, 0).sum(dim=-1) < limit
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


# --- top-p split across many programs: a radix select on exact masses -------------------------
#
# The search above is one program a row and thirty passes over it, so a batch of a few rows
# leaves nearly every SM idle (~365 us on an H100 at any batch up to the SM count). Here a
# row is split into chunks, one program each, and the threshold's bit pattern is found a
# few bits a round, most significant first (the patterns of non-negative floats order as
# their values, and a probability's lies below 2**30): in round r every program adds the
# mass of each of its tokens whose pattern matches the bits chosen so far into the bin of
# its next bits, and the next round (or the last launch) picks the highest bin whose mass
# at or above it (with the mass above the bins' range) reaches top_p. The threshold this
# lands on is the twin's: the smallest pattern whose mass strictly above is below top_p.
#
# Masses are fixed-point integers, each probability times 2**62 truncated, so sums are exact
# and independent of order: the bins are summed by atomic adds (one per token, whatever the
# bin count, so a round can take 10 bits) yet every run gives the same answer, and the
# kernel equals its twin top_p_threshold_exact_ref bit for bit on any input. It parts from
# the float32 search (top_p_threshold_ref) only where that search's own rounding (about
# 1e-7 of a row's mass a sum) puts a row's mass on the other side of top_p; truncation
# costs each token under 2**-62, under 1e-13 a row at any real vocabulary.

# Figures below: H200, 151,936 columns, softmax of randn * 3 logits and flat (all tied)
# rows, CUDA graphs (benchmarks/issue31-h100/s10/).
FIXED_POINT = 2.0 ** 62  # a row's masses sum to about 1, far below int64's 2**63
# 30 bits in three rounds of 1024 bins. Four rounds of 256 (8, 8, 8, 6) read less of the
# bins and win by up to 15% on randn rows (417 against 478 us at 128 rows), but every round
# of a flat row sends all its tokens' atomics to one bin, so they lose 1390 to 1200 us
# there, past the one-program-a-row search's 1245.
RADIX_BITS = (10, 10, 10)
RADIX_BLOCK = 1024  # columns per iteration of a program
# Programs a round aims at, rows times chunks, but no chunk past RADIX_MAX_CHUNK: 512
# programs beat 2048 up to 32 rows (54 against 64 us at 8: each program reads its row's
# bins whole), while at 128 rows chunks of ~10 blocks beat ~38 (481 against 512 us).
RADIX_PROGRAMS = 512
RADIX_MAX_CHUNK = 8 * RADIX_BLOCK
# Each row's bins are kept in this many copies, chunk c adding into copy c % RADIX_COPIES:
# atomics on one address queue in L2, and most of a row's tokens fall in a few bins (all of
# them in one for a flat row). One row: 57.6 us with one copy, 28.4 with 4, 24.6 with 8.
RADIX_COPIES = 8


def top_p_threshold_radix(probs: torch.Tensor, top_p: torch.Tensor,
                          round_bits: tuple[int, ...] = RADIX_BITS,
                          programs: int = RADIX_PROGRAMS, copies: int = RADIX_COPIES
                          ) -> torch.Tensor:
    """top_p_threshold_triton's contract (rows summing to at most about 1), its threshold
    found on exact masses (top_p_threshold_exact_ref): len(round_bits) + 1 launches and a
    fill, whatever the batch, rows x chunks programs each. round_bits, programs and copies
    are for benchmarks/gpu/top_p_sweep.py to try others."""
    rows, vocab = probs.shape
    assert probs.dtype == torch.float32 and probs.stride(1) == 1 and sum(round_bits) == 30
    assert copies & (copies - 1) == 0  # a power of two, as tl.arange needs
    chunk = min(triton.cdiv(vocab, max(1, programs // rows)), RADIX_MAX_CHUNK)
    chunk = triton.cdiv(chunk, RADIX_BLOCK) * RADIX_BLOCK
    grid = (rows, triton.cdiv(vocab, chunk))
    # every round's bins in one buffer: one fill, not one a round
    sizes = [rows * copies << bits for bits in round_bits]
    bins = torch.zeros(sum(sizes), dtype=torch.int64, device=probs.device).split(sizes)
    # (lowest pattern still possible, mass above its range) per row after rounds 0..R-2
    state = torch.empty(len(round_bits) - 1, rows, 2, dtype=torch.int64, device=probs.device)
    shift = 30
    for r, bits in enumerate(round_bits):
        shift -= bits
        prev = max(r - 1, 0)  # round 0 reads nothing before it; any valid buffer will do
        _top_p_bins_kernel[grid](
            probs, probs.stride(0), top_p, bins[prev], bins[r], state, vocab, chunk,
            ROUND=r, SHIFT=shift, BITS=bits, PREV_SHIFT=shift + bits,
            PREV_BITS=round_bits[prev], COPIES=copies, SCALE=FIXED_POINT, BLOCK=RADIX_BLOCK,
            num_warps=4)
    out = torch.empty(rows, dtype=torch.float32, device=probs.device)
    _top_p_pick_kernel[(rows,)](top_p, bins[-1], state, out, ROUND=len(round_bits),
                                BITS=round_bits[-1], COPIES=copies, SCALE=FIXED_POINT,
                                num_warps=4)
    return out


def top_p_threshold_exact_ref(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_p_threshold_ref's search on the radix kernel's fixed-point masses, whose sums are
    exact: the radix kernel's twin, equal to it on any input."""
    mass = (probs * FIXED_POINT).to(torch.int64)
    limit = torch.ceil(top_p * FIXED_POINT).to(torch.int64)  # integer mass < top_p * 2**62
    return _pattern_search(probs, mass, limit, top_p)


@triton.jit
def _narrow(bins_ptr, lo, above, limit, SHIFT: tl.constexpr, BITS: tl.constexpr,
            COPIES: tl.constexpr):
    """One round's choice for a row: the bins hold the masses of the tokens matching lo's
    bits above SHIFT + BITS, keyed by their next BITS bits; the threshold lies in the
    highest bin whose mass at or above it reaches top_p (bin 0 if none does: every token
    may stay). Returns lo with that bin's bits and the mass above that bin."""
    idx = tl.arange(0, 1 << BITS)
    mass = tl.sum(tl.load(bins_ptr + tl.arange(0, COPIES)[:, None] * (1 << BITS) + idx), axis=0)
    at_or_above = above + tl.cumsum(mass, axis=0, reverse=True)
    pick = tl.max(tl.where(at_or_above >= limit, idx, 0), axis=0)
    above = above + tl.sum(tl.where(idx > pick, mass, 0), axis=0)
    return lo | (pick.to(tl.int64) << SHIFT), above


@triton.jit
def _row_state(top_p_ptr, prev_bins_ptr, state_ptr, row, rows, ROUND: tl.constexpr,
               SHIFT: tl.constexpr, BITS: tl.constexpr, COPIES: tl.constexpr,
               SCALE: tl.constexpr):
    """(lo, mass above lo's range) after round ROUND - 1's choice: every program of a row
    makes it from the same integers, so all agree; the caller stores it once."""
    limit = tl.ceil(tl.load(top_p_ptr + row) * SCALE).to(tl.int64)
    if ROUND == 1:
        lo = tl.zeros([], tl.int64)
        above = tl.zeros([], tl.int64)
    else:
        lo = tl.load(state_ptr + ((ROUND - 2) * rows + row) * 2)
        above = tl.load(state_ptr + ((ROUND - 2) * rows + row) * 2 + 1)
    return _narrow(prev_bins_ptr + row * COPIES * (1 << BITS), lo, above, limit, SHIFT, BITS,
                   COPIES)


@triton.jit
def _top_p_bins_kernel(probs_ptr, stride_row, top_p_ptr, prev_bins_ptr, bins_ptr, state_ptr,
                       vocab, chunk, ROUND: tl.constexpr, SHIFT: tl.constexpr,
                       BITS: tl.constexpr, PREV_SHIFT: tl.constexpr, PREV_BITS: tl.constexpr,
                       COPIES: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    rows = tl.num_programs(0)
    part = tl.program_id(1)
    if ROUND == 0:
        lo = tl.zeros([], tl.int64)
    else:
        lo, above = _row_state(top_p_ptr, prev_bins_ptr, state_ptr, row, rows, ROUND,
                               PREV_SHIFT, PREV_BITS, COPIES, SCALE)
        if part == 0:
            tl.store(state_ptr + ((ROUND - 1) * rows + row) * 2, lo)
            tl.store(state_ptr + ((ROUND - 1) * rows + row) * 2 + 1, above)
    prefix = lo.to(tl.int32) >> (SHIFT + BITS)
    my_bins = bins_ptr + (row * COPIES + part % COPIES) * (1 << BITS)
    end = tl.minimum(part * chunk + chunk, vocab)
    for start in range(part * chunk, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(probs_ptr + row * stride_row + cols, mask=cols < end, other=0.0)
        pattern = x.to(tl.int32, bitcast=True)
        mass = (x * SCALE).to(tl.int64)
        # zeros add nothing: skipping them spares the atomics for dropped tokens
        hit = ((pattern >> (SHIFT + BITS)) == prefix) & (mass > 0)
        key = (pattern >> SHIFT) & ((1 << BITS) - 1)
        # integer adds commute, so the order the atomics land in changes nothing
        tl.atomic_add(my_bins + key, mass, mask=hit, sem="relaxed")


@triton.jit
def _top_p_pick_kernel(top_p_ptr, bins_ptr, state_ptr, out_ptr, ROUND: tl.constexpr,
                       BITS: tl.constexpr, COPIES: tl.constexpr, SCALE: tl.constexpr):
    row = tl.program_id(0)
    lo, _ = _row_state(top_p_ptr, bins_ptr, state_ptr, row, tl.num_programs(0), ROUND, 0,
                       BITS, COPIES, SCALE)
    threshold = lo.to(tl.int32).to(tl.float32, bitcast=True)
    # top_p=1 keeps every token, whatever the fixed-point sums say
    tl.store(out_ptr + row, tl.where(tl.load(top_p_ptr + row) < 1.0, threshold, 0.0))

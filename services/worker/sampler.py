"""Turns one step's logits into tokens (and logprobs), the way vLLM v1 does.

Order: grammar mask -> raw logprobs -> allowed_token_ids -> bad_words -> logit_bias ->
penalties -> min_tokens -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> exponential
race. The grammar mask (structured outputs, services/worker/grammar.py) comes first, as
in vLLM, whose model runner masks the logits before its sampler sees them: logprobs are
those of the masked distribution, and a structured row's min_tokens is in its mask rather
than applied here. The device work is batched over rows with tensors, but
for one step: each seeded request draws its noise from its own generator, so its token
depends on its own logits and seed alone, never on the rest of the batch. On CUDA, a step
whose rows ask for temperature alone (no top-k/p, min-p, penalties, logprobs or seeds)
samples in one Triton pass instead (kernels/sampling.py: the Gumbel-max form of the race),
and a greedy step on the raw logits takes its tokens and logprobs from one read of them
(top_logprobs_triton, which finds any step's logprobs up to MAX_KERNEL_LOGPROBS a row).
A greedy decode step whose rows ask for one logprob at most never reaches the Sampler: a
head of the CUDA graph that computed it samples it (greedy_head, graph_head;
services/worker/cuda_graphs.py).
Nothing sorts the vocabulary: top-p's set comes from a threshold found over each row
(top_p_threshold: Triton kernels on CUDA), top-k's from torch.topk or, for a large k, a
search too. Logprobs are left on the
device, fixed-shape, and leave with the token ids in one copy (SamplerOutput.packed):
nothing in a step waits for the device.
Speculative decoding's rejection sampling draws from the same distributions with the same
noise (services/worker/spec_verify.py).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.messages import StepLogprobs
from common.sampling_params import SamplingParams
from kernels.grammar_mask import apply_token_bitmask
from kernels.sampling import (MAX_KERNEL_LOGPROBS, greedy_tokens, gumbel_argmax_triton,
                              packed_logprobs, top_logprobs_ref, top_logprobs_triton,
                              top_p_threshold_exact_ref, top_p_threshold_radix,
                              top_p_threshold_ref, top_p_threshold_triton)

_SEED_MASK = (1 << 64) - 1  # torch seeds are uint64; any Python int maps into that range
# Up to this k, torch.topk finds the k-th largest logit; past it, a threshold search over
# the whole row costs less than topk's sort of a large k.
TOP_K_BOUND = 1024
# A step of this many rows or fewer finds its top-p threshold by the radix select, a larger
# one by the one-program-a-row search (kernels/sampling.py). On an H200 at 151,936 columns
# (benchmarks/issue31-h100/s10/top-p-sweep.txt, CUDA graphs) the radix select takes 25, 54,
# 82 and 479 us at 1, 8, 16 and 128 rows of randn * 3 logits, against the search's 432, 452,
# 456 and 1245 and a full sort's 81, 380, 531 and 2583. Past 128 it still wins on those rows
# (938 against 1584 us at 256) but not on flat ones, whose atomics all land on one bin (2345
# against 1581); at 128 flat rows it holds even (1200 against 1245), at 1 it is near the
# sort (78 against 73). The sort wins nowhere else, so top-p no longer sorts.
RADIX_TOP_P_ROWS = 128


@dataclass(slots=True)
class SamplingRow:
    """One request's sampling state, kept by the model runner."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens sampled so far (before this step)
    generator: torch.Generator | None  # per-request, from params.seed; None if unseeded
    # Of its params, made once: each step asks every row which path samples it, two or
    # three times over, and asking the params each time cost a 256-row step 170 us of the
    # step thread on the 2-CPU box (a throwaway timing; issue 31).
    fixed_logits: bool = field(init=False)  # no penalty, bias, allowed ids or bad words
    greedy_kernel: bool = field(init=False)  # greedy with logprobs the kernel finds
    min_tokens: int = field(init=False)  # 0 where EOS is never held back
    logprobs: int = field(init=False)  # params.logprobs, -1 for None

    def __post_init__(self) -> None:
        params = self.params
        self.fixed_logits = not (has_penalty(params) or params.logit_bias
                                 or params.allowed_token_ids or params.bad_words_token_ids)
        self.greedy_kernel = (params.greedy and self.fixed_logits
                              and (params.logprobs or 0) <= MAX_KERNEL_LOGPROBS)
        self.min_tokens = 0 if params.structured_outputs is not None else params.min_tokens
        self.logprobs = -1 if params.logprobs is None else params.logprobs


@dataclass(slots=True)
class GrammarMask:
    """The allowed tokens of a step's structured rows, on the logits' device."""
    bitmask: torch.Tensor  # int32 [k, ceil(vocab / 32)], xgrammar's packing
    rows: torch.Tensor  # int64 [k]: the batch row of each bitmask row


@dataclass(slots=True)
class LogprobsLayout:
    """Which rows of a step's packed output carry logprobs, and how many each."""
    rows: list[int]  # the batch rows whose logprobs the packed block holds, ascending
    widths: list[int]  # 1 + each one's params.logprobs; 0 for a row that asked for none
    # rows after the step's in each of the block's parts: a captured graph's padding rows,
    # whose tokens and logprobs nobody reads (graph_head_output)
    padding: int = 0


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [N], on the logits' device
    # int64 [N + ...]: the token ids, then the layout's rows' logprobs ids [R, w], values
    # (their float32 bits) [R, w] and ranks [R], so that one copy brings a step's output to
    # the host; the token ids alone when no row asked for logprobs
    packed: torch.Tensor
    logprobs: LogprobsLayout | None = None

    @classmethod
    def of_tokens(cls, token_ids: torch.Tensor) -> SamplerOutput:
        """A step's output where no row asked for logprobs."""
        return cls(token_ids, token_ids)


def unpack_logprobs(host: torch.Tensor, num_rows: int, layout: LogprobsLayout | None
                    ) -> StepLogprobs | None:
    """The step's logprobs as columns, in batch-row order, from SamplerOutput.packed on
    the host. No record a row: numpy takes the rows' entries at once, and where every row
    fills the block's width (each asked for as many) it takes them as they lie: the masks
    were most of this function's cost at batch 1, which a served chat waits on."""
    if layout is None:
        return None
    count, padding = len(layout.rows), layout.padding
    width = (host.shape[0] - num_rows - count - 2 * padding) // (2 * (count + padding))
    block = host[num_rows + padding:].numpy()
    size, held = count * width, (count + padding) * width
    widths = layout.widths
    ids, ranks = block[:size], block[2 * held:2 * held + count]
    values = block[held:held + size].astype(np.int32).view(np.float32)
    if min(widths) < width:  # each row's first `widths` entries; a row of none, no rank
        asked = np.asarray(widths)
        taken = (np.arange(width)[None, :] < asked[:, None]).ravel()
        ids, values, ranks = ids[taken], values[taken], ranks[asked > 0]
    if count == num_rows:  # then its rows are all of the step's
        step_widths = list(widths)
    else:
        step_widths = [0] * num_rows
        for row, row_width in zip(layout.rows, widths):
            step_widths[row] = row_width
    return StepLogprobs(step_widths, ids.tolist(), values.tolist(), ranks.tolist())


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = make_generator(seed, device)
        self._kernel_seeds = random.Random(seed)  # one Philox key per fused step

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
               mask: GrammarMask | None = None) -> SamplerOutput:
        """`logits` float32 [N, vocab], this step's own (the grammar mask writes into it)."""
        if mask is not None:
            apply_token_bitmask(logits, mask.bitmask, mask.rows)
        if all(map(_plain_greedy, rows)):
            return SamplerOutput.of_tokens(greedy_tokens(logits))
        if all(map(_greedy_on_raw_logits, rows)):
            return self._sample_greedy_with_logprobs(logits, rows)
        if logits.is_cuda and all(_plain_random(row) for row in rows):
            return self._sample_fused(logits, rows)
        logits = logits.float()
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        # Taken before any processing: logprobs describe the model's raw distribution.
        raw = self._rows(logits, wanted, len(rows)) if wanted else None
        processed = apply_bad_words(apply_allowed_token_ids(logits, rows), rows)
        processed = apply_logit_bias(processed, rows)
        processed = block_early_stops(apply_penalties(processed, rows), rows)
        token_ids = self._choose(processed, rows)
        if raw is None:
            return SamplerOutput.of_tokens(token_ids)
        return self._with_logprobs(token_ids, raw, wanted, rows)

    def _sample_greedy_with_logprobs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                                     ) -> SamplerOutput:
        """Greedy rows, some asking for logprobs: their tokens and every row's logprobs in
        one read of the logits, two launches, already packed. Through the general path a
        batch-1 chat with logprobs cost its step an argmax, a one-program pass over the row
        and the packing's copies, and a 256-row step with logprobs=5 half a millisecond of
        host time in the processing it skips (issue 31)."""
        widths = _widths(rows)
        packed = _top_logprobs(logits, max(widths) - 1)
        return SamplerOutput(packed[:len(rows)], packed,
                             LogprobsLayout(list(range(len(rows))), widths))

    def _sample_fused(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                      ) -> SamplerOutput:
        """Temperature-only rows in one Triton pass; the logprobs some of them ask for come
        from the raw logits, which the kernel leaves as they are. Logprobs alone do not
        send a step down the general path: its per-row Python and two dozen launches were
        the step thread's share of what logprobs=1 cost the nano workload (issue 31)."""
        temperature = to_device([row.params.temperature for row in rows], torch.float32,
                                self.device)
        token_ids = gumbel_argmax_triton(logits, temperature, self._kernel_seeds.getrandbits(31))
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not wanted:
            return SamplerOutput.of_tokens(token_ids)
        return self._with_logprobs(token_ids, self._rows(logits.float(), wanted, len(rows)),
                                   wanted, rows)

    # --- choosing tokens ---------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if len(random_rows) == len(rows):
            return self._sample_random(logits, rows)
        token_ids = greedy_tokens(logits)
        if random_rows:
            index = self._tensor(random_rows, torch.int64)
            sampled = self._sample_random(logits[index], [rows[i] for i in random_rows])
            token_ids.index_copy_(0, index, sampled)
        return token_ids

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                       ) -> torch.Tensor:
        probs = self.probs(logits, rows)
        return greedy_tokens(probs.div_(self.exponential_noise(probs, rows)))

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each random row draws from, and speculative verification's p:
        temperature, top-k, top-p, min-p (unnormalized: top-p and min-p zero entries without
        rescaling the rest)."""
        logits = logits / self._column([row.params.temperature for row in rows])
        params = [row.params for row in rows]
        max_k = min(max(p.top_k for p in params), logits.shape[1])
        if max_k > 0:
            logits = apply_top_k(logits, self._tensor([p.top_k for p in params], torch.int64),
                                 max_k)
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            # When every row is cut to a small top k, the top-p set lies among the max_k
            # most likely tokens: a top-k there is cheaper than the threshold search.
            small = 0 < max_k <= TOP_K_BOUND and all(p.top_k > 0 for p in params)
            probs = apply_top_p(probs, self._tensor([p.top_p for p in params], torch.float32),
                                probs.topk(max_k, dim=-1).values if small else None)
        if any(p.min_p > 0.0 for p in params):
            probs = apply_min_p(probs, self._column([p.min_p for p in params]))
        return probs

    def exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]
                          ) -> torch.Tensor:
        """q ~ Exp(1) per entry: argmax(probs / q) is a draw from probs (unnormalised)."""
        noise = torch.empty_like(probs)
        if any(row.generator is None for row in rows):
            noise.exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        # exponential_ may return exactly 0, which would turn a dropped token's 0 into NaN.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    # --- logprobs ----------------------------------------------------------------------

    def _with_logprobs(self, token_ids: torch.Tensor, logits: torch.Tensor, wanted: list[int],
                       rows: Sequence[SamplingRow]) -> SamplerOutput:
        """The step's output with the logprobs of the rows in `wanted`, given their raw
        logits, left on the device: they reach the host with the token ids."""
        widths = [rows[i].params.logprobs + 1 for i in wanted]
        k = max(widths) - 1
        chosen = self._rows(token_ids, wanted, len(rows))
        if k <= MAX_KERNEL_LOGPROBS:
            packed = torch.cat([token_ids, _top_logprobs(logits, k, chosen)[len(wanted):]])
        else:
            packed = packed_logprobs(token_ids, *top_logprobs(
                torch.log_softmax(logits, dim=-1), chosen, k))
        return SamplerOutput(token_ids, packed, LogprobsLayout(wanted, widths))

    def _rows(self, tensor: torch.Tensor, wanted: list[int], num_rows: int) -> torch.Tensor:
        if len(wanted) == num_rows:
            return tensor
        return tensor[self._tensor(wanted, torch.int64)]

    def _tensor(self, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _column(self, values: Sequence[float]) -> torch.Tensor:
        return _column(values, self.device)


def apply_allowed_token_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]
                            ) -> torch.Tensor:
    """-inf on every token outside a row's allowed_token_ids. Returns `logits` itself when
    no row restricts its tokens."""
    limited = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if not limited:
        return logits
    vocab_size = logits.shape[1]
    flat = [j * vocab_size + t for j, i in enumerate(limited)
            for t in rows[i].params.allowed_token_ids if t < vocab_size]
    forbidden = torch.ones(len(limited) * vocab_size, dtype=torch.bool)
    forbidden[flat] = False  # built on the host: one copy to the device, not one per row
    index = to_device(limited, torch.int64, logits.device)
    out = logits.clone()
    out[index] = logits[index].masked_fill(
        forbidden.view(len(limited), vocab_size).to(logits.device, non_blocking=True),
        float("-inf"))
    return out


def apply_bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf on the last token of each bad word whose other tokens are the row's latest
    output tokens (a one-token word: always). The indices are found on the host, from
    the tokens the row already has, so nothing waits for the device. Returns `logits`
    itself when nothing is banned."""
    vocab_size = logits.shape[1]
    flat = [i * vocab_size + t for i, row in enumerate(rows)
            for t in banned_tokens(row.params.bad_words_token_ids, row.output_token_ids)
            if t < vocab_size]
    if not flat:
        return logits
    banned = logits.clone()
    banned.view(-1).index_fill_(0, to_device(flat, torch.int64, logits.device), float("-inf"))
    return banned


def banned_tokens(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of each word whose prefix ends `output`."""
    out = []
    for word in words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == list(word[:-1]):
            out.append(word[-1])
    return out


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Each row's logit_bias added to its logits. Returns `logits` itself when no row has
    one."""
    vocab_size = logits.shape[1]
    pairs = [(i * vocab_size + t, bias) for i, row in enumerate(rows)
             for t, bias in (row.params.logit_bias or {}).items() if t < vocab_size]
    if not pairs:
        return logits
    flat, biases = zip(*pairs)
    out = logits.clone()
    out.view(-1).index_add_(0, to_device(flat, torch.int64, logits.device),
                            to_device(biases, logits.dtype, logits.device))
    return out


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output ids; frequency and presence penalties over
    output ids. Returns `logits` itself when no row has a penalty."""
    if not any(has_penalty(row.params) for row in rows):
        return logits
    device = logits.device
    # Only penalised rows contribute ids, so long prompts of the others are not copied.
    outputs = [row.output_token_ids if has_penalty(row.params) else () for row in rows]
    prompts = [row.prompt_token_ids if row.params.repetition_penalty != 1.0 else ()
               for row in rows]
    counts = _token_counts(outputs, logits.shape[1], device)
    seen = (_token_counts(prompts, logits.shape[1], device) > 0) | (counts > 0)
    repetition = _column([row.params.repetition_penalty for row in rows], device)
    frequency = _column([row.params.frequency_penalty for row in rows], device)
    presence = _column([row.params.presence_penalty for row in rows], device)
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = torch.where(seen, scaled, logits)
    return penalised - frequency * counts - presence * (counts > 0).float()


def block_early_stops(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf on the EOS and stop token ids of rows still short of min_tokens (whatever
    ignore_eos says, as vLLM does), but structured ones, whose grammar mask holds them
    back. Returns `logits` itself when nothing is blocked."""
    vocab_size = logits.shape[1]
    flat = [i * vocab_size + t for i, row in enumerate(rows) if _blocks_early_stops(row)
            for t in (*row.params.eos_token_ids, *row.params.stop_token_ids)
            if t < vocab_size]  # an id past the vocabulary can never be sampled anyway
    if not flat:
        return logits
    blocked = logits.clone()
    # index_fill_ takes the value as a scalar; item assignment would copy it to the device
    # as a tensor, a blocking copy.
    blocked.view(-1).index_fill_(0, to_device(flat, torch.int64, logits.device), float("-inf"))
    return blocked


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's logits >= its k-th largest (ties at the k-th all stay); k=0 keeps all.
    max_k: the largest k of any row, at most the vocabulary size."""
    vocab_size = logits.shape[1]
    if max_k > TOP_K_BOUND:
        kth = top_k_threshold(logits, top_k)
    else:
        largest = logits.topk(max_k, dim=-1).values
        kth = largest.gather(1, (top_k.clamp(1, largest.shape[1]) - 1).unsqueeze(1))[:, 0]
    enabled = (top_k > 0) & (top_k < vocab_size)
    kth = torch.where(enabled, kth, float("-inf")).unsqueeze(1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """float32 [rows]: each row's k-th largest logit (k >= 1), by a binary search rather
    than a sort. A logit is in the top k when fewer than k logits exceed it, a count that
    only falls as the logit rises; mapping a float32's bits to an integer that orders as
    its value (negative patterns reversed) makes the search 32 steps over the integers."""
    rows = logits.shape[0]
    logits = logits.float()
    lo = torch.full((rows,), _ordered_key(float("-inf")), dtype=torch.int64,
                    device=logits.device)
    hi = torch.full_like(lo, _ordered_key(float("inf")))
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        fewer = (logits > _key_value(mid).unsqueeze(1)).sum(dim=-1) < top_k
        hi = torch.where(fewer, mid, hi)
        lo = torch.where(fewer, lo, mid + 1)
    return _key_value(hi)


def _ordered_key(value: float) -> int:
    bits = int(np.float32(value).view(np.int32))
    return bits if bits >= 0 else bits ^ 0x7FFFFFFF


def _key_value(key: torch.Tensor) -> torch.Tensor:
    """The float32 whose _ordered_key is `key` (int64)."""
    bits = torch.where(key >= 0, key, key ^ 0x7FFFFFFF).to(torch.int32)
    return bits.view(torch.float32)


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor,
                ordered: torch.Tensor | None = None) -> torch.Tensor:
    """Zero all but the smallest most-likely set whose mass reaches top_p (and tokens tied
    with its least likely member); top_p=1 keeps everything. Without `ordered`, a
    threshold found over the whole row, no sort (top_p_threshold). `ordered` may hold
    each row's m largest probabilities, descending, where no row has more than m nonzero
    ones but for ties with the m-th: the threshold found among them is the one a full
    sort finds."""
    if ordered is None:
        threshold = top_p_threshold(probs.contiguous(), top_p)
        return probs.masked_fill(probs < threshold.unsqueeze(1), 0.0)
    width = ordered.shape[1]
    before = (ordered.cumsum(dim=-1) < top_p.unsqueeze(1)).sum(dim=-1)
    # Rounding can leave a cumsum short of 1.0, so top_p=1 is not left to the arithmetic.
    num_kept = torch.where(top_p < 1.0, before + 1, width).clamp_max(width)
    least_kept = ordered.gather(1, (num_kept - 1).unsqueeze(1))
    return probs.masked_fill(probs < least_kept, 0.0)


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p threshold (kernels/sampling.py): up to RADIX_TOP_P_ROWS rows the
    radix select on exact masses, past it the search on float32 ones; on CPU each kernel's
    torch twin, so a CPU run keeps the tokens a GPU keeps. The two differ only where float
    rounding puts a row's mass on the other side of top_p."""
    if probs.shape[0] <= RADIX_TOP_P_ROWS:
        return (top_p_threshold_radix if probs.is_cuda else top_p_threshold_exact_ref)(
            probs, top_p)
    return (top_p_threshold_triton if probs.is_cuda else top_p_threshold_ref)(probs, top_p)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely token."""
    floor = min_p * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < floor, 0.0)


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [R, k+1], logprobs [R, k+1], ranks [R]): column 0 the chosen token, then the
    top-k; rank = 1 + how many tokens are strictly more likely than the chosen one."""
    chosen = chosen.long().unsqueeze(1)
    chosen_logprob = logprobs.gather(1, chosen)
    top = logprobs.topk(k, dim=-1)
    ranks = (logprobs > chosen_logprob).sum(dim=-1) + 1
    return (torch.cat([chosen, top.indices], dim=1),
            torch.cat([chosen_logprob, top.values], dim=1), ranks)


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of each next prompt token plus the top-k, from the raw logits."""
    return top_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, k)


# --- sampling inside a decode step's CUDA graph ------------------------------------------

# The k of each head a decode graph has (services/worker/cuda_graphs.py), smallest first:
# the argmax, then the top-logprobs kernel at the widths the OpenAI API asks for most: a
# chat's `logprobs: true` or top_logprobs=1, the completions API's most (5), and a chat's
# most, vLLM's --max-logprobs default (20). A row of k logprobs takes the smallest head of
# k or more. Each entry more is two more reductions over the chunk the kernel holds, not
# another read of the logits; a step left to the sampler costs the host its launches, five
# or so and their allocations, which a large batch's steps wait on (issue 31).
GRAPH_HEADS = (0, 1, 5, 20)


def graph_head(rows: Sequence[SamplingRow]) -> int | None:
    """Which head of a decode graph samples these rows: 0, the argmax (no row asks for
    logprobs), or the smallest top-logprobs head wide enough for every row; None where a
    row needs the sampler (a random draw, processed logits, more logprobs)."""
    if not all(map(_greedy_on_raw_logits, rows)):
        return None
    most = max(row.logprobs for row in rows)
    if most < 0:
        return 0
    return next((k for k in GRAPH_HEADS[1:] if k >= most), None)


def greedy_head(logits: torch.Tensor, k: int) -> torch.Tensor:
    """What head k computes from a graph's logits, fixed-shape: the greedy tokens (k = 0),
    or those and k top logprobs a row, packed (SamplerOutput.packed's layout, over every
    row of the graph)."""
    return greedy_tokens(logits) if k == 0 else _top_logprobs(logits, k)


def graph_head_output(out: torch.Tensor, rows: Sequence[SamplingRow], k: int
                      ) -> SamplerOutput:
    """The step's output from head k's `out` over a graph's rows, of which the step's are
    the first: the padding rows' tokens and logprobs go unread."""
    if k == 0:
        return SamplerOutput.of_tokens(out[:len(rows)])
    padding = out.shape[0] // (2 * k + 4) - len(rows)
    return SamplerOutput(out[:len(rows)], out,
                         LogprobsLayout(list(range(len(rows))), _widths(rows), padding))


def _widths(rows: Sequence[SamplingRow]) -> list[int]:
    """Each row's logprobs entries: its chosen token's and its top ones; 0 for none."""
    return [0 if row.params.logprobs is None else row.params.logprobs + 1 for row in rows]


def _top_logprobs(logits: torch.Tensor, k: int, chosen: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """kernels/sampling.py's packed logprobs (k of them, 1 at least) of these logits: the
    kernel on CUDA, its twin elsewhere."""
    top = top_logprobs_triton if logits.is_cuda else top_logprobs_ref
    return top(logits, max(k, 1), chosen)


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # non_blocking: a pageable host->device copy is staged by the driver, so unlike a
    # blocking copy it does not wait for the GPU queue to drain.
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """float32 [rows, 1], to broadcast one value per row over the vocabulary."""
    return to_device(values, torch.float32, device).unsqueeze(1)


def _token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """float32 [rows, vocab]: how often each id occurs in each row's list."""
    lengths = [len(ids) for ids in token_lists]
    # One pass over all ids: converting list by list costs about twice as much.
    ids = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, sum(lengths))
    ids += np.repeat(np.arange(len(token_lists), dtype=np.int64) * vocab_size, lengths)
    flat = torch.from_numpy(ids).to(device, non_blocking=True)
    counts = torch.zeros(len(token_lists) * vocab_size, device=device)
    # index_add_, not bincount: bincount reads the largest id back to size its output.
    counts.index_add_(0, flat, torch.ones(flat.shape, device=device))
    return counts.view(len(token_lists), vocab_size)


def has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


def _blocks_early_stops(row: SamplingRow) -> bool:
    return row.min_tokens > 0 and len(row.output_token_ids) < row.min_tokens


def _plain_random(row: SamplingRow) -> bool:
    """Temperature alone shapes the draw, from the engine's noise: one fused kernel does it
    (logprobs, read from the raw logits, change nothing in the draw)."""
    params = row.params
    return (not params.greedy and _unchanged_logits(row) and params.top_k == 0
            and params.top_p == 1.0 and params.min_p == 0.0 and row.generator is None)


def _plain_greedy(row: SamplingRow) -> bool:
    return row.params.greedy and _raw_logits(row)


def _greedy_on_raw_logits(row: SamplingRow) -> bool:
    """Greedy on the raw logits, asking for as many logprobs as one read of them finds."""
    return row.greedy_kernel and not _blocks_early_stops(row)


def _raw_logits(row: SamplingRow) -> bool:
    """Nothing changes the row's logits before the choice, nor asks for their logprobs."""
    return row.logprobs < 0 and _unchanged_logits(row)


def _unchanged_logits(row: SamplingRow) -> bool:
    """Nothing changes the row's logits before the choice."""
    return row.fixed_logits and not _blocks_early_stops(row)

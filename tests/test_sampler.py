"""Sampler against naive references: greedy, temperature frequencies, the top-k / top-p /
min-p sets, penalties, min_tokens, seeds, logprobs and prompt logprobs.

Runs on the CPU, and on CUDA as well where there is one."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from common.messages import TokenLogprobs
from common.sampling_params import SamplingParams
from services.worker.sampler import (
    GRAPH_HEADS, RADIX_TOP_P_ROWS, GrammarMask, Sampler, SamplerOutput, SamplingRow,
    apply_min_p, apply_penalties, apply_top_k, apply_top_p, graph_head, graph_head_output,
    greedy_head, make_generator, prompt_logprobs, top_k_threshold, top_logprobs,
    unpack_logprobs)

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES, ids=str)
def device(request: pytest.FixtureRequest) -> torch.device:
    return request.param


def seeded_logits(seed: int, rows: int, vocab: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def make_row(params: SamplingParams, device: torch.device, prompt: Sequence[int] = (),
             output: Sequence[int] = ()) -> SamplingRow:
    generator = None if params.seed is None else make_generator(params.seed, device)
    return SamplingRow(params, list(prompt), list(output), generator)


def within_sigmas(observed: torch.Tensor, expected: torch.Tensor, draws: int,
                  sigmas: float = 5.0) -> bool:
    # Each frequency is a mean of `draws` Bernoulli(p) variables, so its standard deviation
    # is sqrt(p(1-p)/draws); 5 of them bound a chance miss per entry at about 6e-7, and the
    # seeds are fixed, so the test is deterministic as well as unlikely to sit on the edge.
    bound = sigmas * torch.sqrt(expected * (1 - expected) / draws) + 1e-9
    return bool(((observed - expected).abs() <= bound).all())


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab).double() / tokens.numel()


# --- references ----------------------------------------------------------------------------

def ref_top_k(logits: list[float], k: int) -> set[int]:
    return {i for i, x in enumerate(logits) if k == 0 or sum(y > x for y in logits) < k}


def ref_top_p(probs: list[float], p: float) -> set[int]:
    return {i for i, x in enumerate(probs) if sum(y for y in probs if y > x) < p}


def ref_min_p(probs: list[float], m: float) -> set[int]:
    return {i for i, x in enumerate(probs) if x >= m * max(probs)}


def ref_allowed(logits: list[float], params: SamplingParams) -> set[int]:
    """Temperature, top-k, top-p on the renormalised top-k, then min-p; in float64."""
    scaled = [x / params.temperature for x in logits]
    kept = ref_top_k(scaled, params.top_k)
    top = max(scaled)
    weights = [math.exp(x - top) if i in kept else 0.0 for i, x in enumerate(scaled)]
    probs = [w / sum(weights) for w in weights]
    return kept & ref_top_p(probs, params.top_p) & ref_min_p(probs, params.min_p)


def ref_penalised(logits: list[float], params: SamplingParams, prompt: Sequence[int],
                  output: Sequence[int]) -> list[float]:
    out = []
    for t, x in enumerate(logits):
        if t in prompt or t in output:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        count = output.count(t)
        out.append(x - params.frequency_penalty * count - params.presence_penalty * (count > 0))
    return out


@contextlib.contextmanager
def forbid_syncs(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def host_logprobs(out: SamplerOutput, num_rows: int) -> list[TokenLogprobs | None]:
    """The step's logprobs as the worker reads them out of the one packed copy, and the
    scheduler takes them apart."""
    columns = unpack_logprobs(out.packed.cpu(), num_rows, out.logprobs)
    return [] if columns is None else columns.rows()


# --- greedy --------------------------------------------------------------------------------

def test_all_greedy_is_argmax(device: torch.device) -> None:
    logits = seeded_logits(0, 7, 300).to(device)
    rows = [make_row(SamplingParams(temperature=0.0), device) for _ in range(7)]
    out = Sampler(device, 0).sample(logits, rows)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == device.type
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.packed is out.token_ids


def test_greedy_rows_beside_random_rows_are_argmax(device: torch.device) -> None:
    logits = seeded_logits(1, 8, 200).to(device)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, top_k=20, seed=5),
              SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.7),
              SamplingParams(temperature=0.0, min_tokens=1, eos_token_ids=(7,)),
              SamplingParams(temperature=1.0, min_p=0.1),
              SamplingParams(temperature=0.0, presence_penalty=0.0, frequency_penalty=0.0),
              SamplingParams(temperature=2.0)]
    rows = [make_row(p, device, output=[1, 2]) for p in params]
    out = Sampler(device, 0).sample(logits, rows)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    expected = logits.argmax(dim=-1)
    assert torch.equal(out.token_ids[greedy], expected[greedy])
    assert ((out.token_ids >= 0) & (out.token_ids < 200)).all()


# --- temperature and the filtered distributions ---------------------------------------------

def test_temperature_frequencies_match_softmax(device: torch.device) -> None:
    vocab, draws, temperature = 6, 60_000, 0.7
    logits = seeded_logits(2, 1, vocab, scale=1.5)
    rows = [make_row(SamplingParams(temperature=temperature), device)] * draws
    out = Sampler(device, 11).sample(logits.expand(draws, vocab).to(device), rows)
    expected = torch.softmax(logits[0].double() / temperature, dim=-1)
    assert within_sigmas(frequencies(out.token_ids, vocab), expected, draws)


def test_seeded_rows_sample_from_softmax(device: torch.device) -> None:
    vocab, draws = 5, 4000
    logits = seeded_logits(3, 1, vocab)
    rows = [make_row(SamplingParams(temperature=1.0, seed=seed), device)
            for seed in range(draws)]
    out = Sampler(device, 0).sample(logits.expand(draws, vocab).to(device), rows)
    expected = torch.softmax(logits[0].double(), dim=-1)
    assert within_sigmas(frequencies(out.token_ids, vocab), expected, draws)


def test_filtered_frequencies_match_renormalised_reference(device: torch.device) -> None:
    vocab, draws = 10, 60_000
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.85, min_p=0.08)
    logits = seeded_logits(4, 1, vocab, scale=1.2)
    allowed = ref_allowed(logits[0].tolist(), params)
    scaled = logits[0].double() / params.temperature
    mask = torch.tensor([i not in allowed for i in range(vocab)])
    expected = torch.softmax(scaled.masked_fill(mask, float("-inf")), dim=-1)
    assert 2 < len(allowed) < 6  # the filters really cut, and more than one token is left
    rows = [make_row(params, device)] * draws
    out = Sampler(device, 12).sample(logits.expand(draws, vocab).to(device), rows)
    observed = frequencies(out.token_ids, vocab)
    assert set(torch.nonzero(observed).flatten().tolist()) == allowed
    assert within_sigmas(observed, expected, draws)


# --- the top-k / top-p / min-p sets ------------------------------------------------------------

def tied_logits(seed: int, rows: int, vocab: int) -> torch.Tensor:
    # One decimal place: many exact ties, including at the k-th value and the top-p edge.
    return torch.round(seeded_logits(seed, rows, vocab) * 2) / 2


def test_top_k_set_matches_reference(device: torch.device) -> None:
    rng = random.Random(5)
    logits = tied_logits(5, 64, 12)
    ks = [rng.choice([0, 1, 2, 3, 5, 8, 11, 12, 20]) for _ in range(64)]
    kept = apply_top_k(logits.to(device), torch.tensor(ks, device=device), 12)
    for row, k, out in zip(logits.tolist(), ks, kept.cpu()):
        assert set(torch.nonzero(torch.isfinite(out)).flatten().tolist()) == ref_top_k(row, k)
        assert torch.equal(out[torch.isfinite(out)], torch.tensor(row)[torch.isfinite(out)])


def test_top_p_set_matches_reference(device: torch.device) -> None:
    rng = random.Random(6)
    probs = torch.softmax(tied_logits(6, 64, 12), dim=-1)
    ps = [rng.choice([0.01, 0.2, 0.5, 0.75, 0.9, 0.99, 1.0]) for _ in range(64)]
    kept = apply_top_p(probs.to(device), torch.tensor(ps, device=device))
    for row, p, out in zip(probs.double().tolist(), ps, kept.cpu()):
        assert set(torch.nonzero(out).flatten().tolist()) == ref_top_p(row, p)
    assert torch.equal(kept[torch.tensor(ps) == 1.0].cpu(), probs[torch.tensor(ps) == 1.0])


def test_top_p_among_the_top_k_equals_top_p_over_the_vocabulary(device: torch.device) -> None:
    rng = random.Random(18)
    logits, ks = tied_logits(18, 64, 40).to(device), [rng.randrange(1, 9) for _ in range(64)]
    ps = torch.tensor([rng.choice([0.1, 0.5, 0.8, 0.95, 1.0]) for _ in range(64)], device=device)
    probs = torch.softmax(apply_top_k(logits, torch.tensor(ks, device=device), 8), dim=-1)
    assert (torch.count_nonzero(probs, dim=-1) > torch.tensor(ks, device=device)).any()  # ties
    full = apply_top_p(probs, ps)
    assert torch.equal(apply_top_p(probs, ps, probs.topk(8, dim=-1).values), full)
    assert not torch.equal(full, probs)


@pytest.mark.parametrize("top_p, kept", [(0.5, {0}), (0.75, {0, 1}), (0.875, {0, 1, 2}),
                                          (0.9, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_stops_where_the_mass_is_reached_exactly(device: torch.device, top_p: float,
                                                       kept: set[int]) -> None:
    # Powers of two sum exactly, so a set whose mass equals top_p is not widened by rounding.
    probs = torch.tensor([[0.125, 0.5, 0.0625, 0.25, 0.0625]])
    order = [1, 3, 0, 2, 4]  # the positions of 0.5, 0.25, 0.125, 0.0625, 0.0625
    out = apply_top_p(probs.to(device), torch.tensor([top_p], device=device)).cpu()[0]
    assert set(torch.nonzero(out).flatten().tolist()) == {order[i] for i in kept}
    assert ref_top_p(probs[0].tolist(), top_p) == {order[i] for i in kept}


def test_min_p_set_matches_reference(device: torch.device) -> None:
    rng = random.Random(7)
    probs = torch.softmax(tied_logits(7, 64, 12), dim=-1)
    ms = [rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]) for _ in range(64)]
    kept = apply_min_p(probs.to(device), torch.tensor(ms, device=device).unsqueeze(1))
    for row, m, out in zip(probs.tolist(), ms, kept.cpu()):
        assert set(torch.nonzero(out).flatten().tolist()) == ref_min_p(row, m)


def test_sampled_tokens_stay_inside_the_allowed_set(device: torch.device) -> None:
    rng = random.Random(8)
    vocab, num_rows = 16, 24
    params = [SamplingParams(temperature=rng.choice([0.3, 1.0, 1.7]),
                             top_k=rng.choice([0, 1, 3, 7]),
                             top_p=rng.choice([0.3, 0.8, 1.0]),
                             min_p=rng.choice([0.0, 0.1, 0.4]),
                             seed=rng.choice([None, rng.randrange(1000)]))
              for _ in range(num_rows)]
    logits = tied_logits(8, num_rows, vocab)
    allowed = [ref_allowed(row, p) for row, p in zip(logits.tolist(), params)]
    rows = [make_row(p, device) for p in params]
    sampler = Sampler(device, 3)
    seen: list[set[int]] = [set() for _ in range(num_rows)]
    for _ in range(60):
        for i, token in enumerate(sampler.sample(logits.to(device), rows).token_ids.tolist()):
            seen[i].add(token)
    for got, want in zip(seen, allowed):
        assert got <= want
    assert any(len(got) > 1 for got in seen)


# --- penalties and min_tokens ---------------------------------------------------------------------

def penalty_case(seed: int) -> tuple[torch.Tensor, list[SamplingParams], list[list[int]],
                                     list[list[int]]]:
    rng = random.Random(seed)
    vocab, num_rows = 40, 7
    params = [SamplingParams(temperature=0.0,
                             repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
                             presence_penalty=rng.choice([0.0, -0.5, 0.8]),
                             frequency_penalty=rng.choice([0.0, 0.4, -1.1]))
              for _ in range(num_rows - 1)] + [SamplingParams(temperature=0.0)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(16))]
               for _ in range(num_rows)]
    outputs = [[rng.randrange(vocab // 2) for _ in range(rng.randrange(21))]
               for _ in range(num_rows)]
    return seeded_logits(seed, num_rows, vocab, scale=3.0), params, prompts, outputs


@pytest.mark.parametrize("seed", [9, 10, 11])
def test_penalties_match_naive_reference(device: torch.device, seed: int) -> None:
    logits, params, prompts, outputs = penalty_case(seed)
    rows = [make_row(p, device, pr, out) for p, pr, out in zip(params, prompts, outputs)]
    expected = torch.tensor([ref_penalised(row, p, pr, out) for row, p, pr, out
                             in zip(logits.tolist(), params, prompts, outputs)])
    got = apply_penalties(logits.to(device), rows).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    tokens = Sampler(device, 0).sample(logits.to(device), rows).token_ids.cpu()
    assert torch.equal(tokens, expected.argmax(dim=-1))


def test_no_penalty_leaves_logits_untouched(device: torch.device) -> None:
    logits = seeded_logits(12, 3, 20).to(device)
    rows = [make_row(SamplingParams(), device, [1, 2, 3], [4, 4, 5])] * 3
    assert apply_penalties(logits, rows) is logits


def test_min_tokens_blocks_eos_and_stop_ids_until_reached(device: torch.device) -> None:
    vocab, eos, stop, draws = 30, 3, 7, 200
    logits = seeded_logits(13, 1, vocab)
    logits[0, eos], logits[0, stop] = 25.0, 20.0  # both would win every draw if allowed
    variants = [SamplingParams(temperature=0.0, min_tokens=4, eos_token_ids=(eos,),
                               stop_token_ids=(stop, vocab + 50)),
                SamplingParams(temperature=1.0, min_tokens=4, eos_token_ids=(eos,),
                               stop_token_ids=(stop,), ignore_eos=True, seed=1),
                SamplingParams(temperature=1.0, min_tokens=4, eos_token_ids=(eos,),
                               stop_token_ids=(stop,))]
    sampler = Sampler(device, 4)
    for params in variants:
        for done in range(5):
            rows = [make_row(params, device, [1], list(range(10, 10 + done)))] * draws
            tokens = sampler.sample(logits.expand(draws, vocab).to(device), rows).token_ids
            blocked = (tokens == eos) | (tokens == stop)
            assert bool(blocked.any()) == (done >= 4) and bool(blocked.all()) == (done >= 4)


# --- logit_bias and allowed_token_ids ----------------------------------------------------------

def test_allowed_token_ids_and_logit_bias_shape_greedy_choices(device: torch.device) -> None:
    vocab = 50
    logits = seeded_logits(14, 5, vocab).to(device)
    best = logits.argmax(dim=-1).tolist()
    others = [[t for t in range(vocab) if t != b] for b in best]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=others[0][:7]),
              SamplingParams(temperature=0.0, logit_bias={others[1][3]: 100}),
              SamplingParams(temperature=0.0, logit_bias={best[2]: -100}),
              SamplingParams(temperature=0.0, allowed_token_ids=[others[3][9]],
                             logit_bias={others[3][9]: -100, best[3]: 100}),
              SamplingParams(temperature=0.0)]
    rows = [make_row(p, device) for p in params]
    tokens = Sampler(device, 0).sample(logits.clone(), rows).token_ids.tolist()
    restricted = logits[0, others[0][:7]]
    assert tokens[0] == others[0][int(restricted.argmax())]
    assert tokens[1] == others[1][3]
    assert tokens[2] == int(logits[2].clone().index_fill_(0, torch.tensor(best[2], device=device),
                                                          float("-inf")).argmax())
    assert tokens[3] == others[3][9]  # only one token is allowed, whatever its bias
    assert tokens[4] == best[4]  # a row without either is untouched by its neighbours'


def test_biased_and_restricted_frequencies_match_softmax(device: torch.device) -> None:
    vocab, draws, allowed = 8, 40_000, [1, 4, 6]
    logits = seeded_logits(15, 1, vocab, scale=1.0)
    bias = {0: 2.0, 5: -1.5, 6: 0.5}
    for params, expected_logits in (
            (SamplingParams(temperature=1.0, logit_bias=bias),
             logits[0] + torch.tensor([bias.get(t, 0.0) for t in range(vocab)])),
            (SamplingParams(temperature=0.8, allowed_token_ids=allowed, logit_bias=bias),
             torch.where(torch.isin(torch.arange(vocab), torch.tensor(allowed)),
                         (logits[0] + torch.tensor([bias.get(t, 0.0) for t in range(vocab)]))
                         / 0.8, float("-inf")))):
        rows = [make_row(params, device)] * draws
        out = Sampler(device, 16).sample(logits.expand(draws, vocab).to(device), rows)
        expected = torch.softmax(expected_logits.double(), dim=-1)
        assert within_sigmas(frequencies(out.token_ids, vocab), expected, draws)


def test_logprobs_stay_raw_under_bias_and_restriction(device: torch.device) -> None:
    logits = seeded_logits(16, 1, 30).to(device)
    params = SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[3, 4],
                            logit_bias={3: 50.0})
    out = Sampler(device, 0).sample(logits.clone(), [make_row(params, device)])
    entry = host_logprobs(out, 1)[0]
    raw = torch.log_softmax(logits[0].float(), dim=-1)
    assert out.token_ids.tolist() == [3] and entry.token_ids[0] == 3
    assert entry.logprobs[0] == pytest.approx(float(raw[3]), abs=1e-5)
    assert entry.token_ids[1:] == raw.topk(2).indices.tolist()


# --- seeds -------------------------------------------------------------------------------------

TARGET_VOCAB = 500


def target_logits(step: int) -> torch.Tensor:
    return seeded_logits(100 + step, 1, TARGET_VOCAB, scale=0.5)[0]


def run_target(device: torch.device, seed: int, crowd: bool, steps: int = 6) -> list[int]:
    """Sample a seeded request for `steps` steps, alone or in a varying crowd of others."""
    rng = random.Random(seed * 7 + crowd)
    params = SamplingParams(temperature=1.0, top_p=0.97, top_k=400, seed=seed)
    target = make_row(params, device, prompt=[1, 2, 3])
    others = [make_row(SamplingParams(temperature=rng.choice([0.0, 0.6, 1.2]), top_k=50,
                                      seed=rng.choice([None, rng.randrange(99)])), device)
              for _ in range(8)]
    sampler = Sampler(device, rng.randrange(1000))
    tokens = []
    for step in range(steps):
        batch = rng.sample(others, rng.randrange(8)) if crowd else []
        position = rng.randrange(len(batch) + 1)
        batch.insert(position, target)
        logits = torch.randn(len(batch), TARGET_VOCAB, generator=torch.Generator().manual_seed(
            rng.randrange(1 << 30)))
        logits[position] = target_logits(step)
        token = sampler.sample(logits.to(device), batch).token_ids[position].item()
        target.output_token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seed_fixes_tokens_whatever_the_batch(device: torch.device) -> None:
    alone = run_target(device, seed=1234, crowd=False)
    assert run_target(device, seed=1234, crowd=True) == alone
    assert run_target(device, seed=4321, crowd=True) != alone


def test_shared_generator_follows_the_sampler_seed(device: torch.device) -> None:
    logits = seeded_logits(14, 16, 300).to(device)
    rows = [make_row(SamplingParams(temperature=1.0), device)] * 16
    first = Sampler(device, 21).sample(logits, rows).token_ids
    assert torch.equal(Sampler(device, 21).sample(logits, rows).token_ids, first)
    assert not torch.equal(Sampler(device, 22).sample(logits, rows).token_ids, first)


def test_make_generator_takes_any_int_seed(device: torch.device) -> None:
    for seed in (0, -1, 2**63, -(2**63), 2**64 + 5):
        a = torch.rand(4, generator=make_generator(seed, device), device=device)
        b = torch.rand(4, generator=make_generator(seed, device), device=device)
        assert torch.equal(a, b)


# --- logprobs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ks", [[0, 3, None, 5, 1, 2], [2, 0, 4, 1, 1, 3]])
def test_logprobs_come_from_raw_logits(device: torch.device, ks: list[int | None]) -> None:
    vocab = 50
    params = [SamplingParams(temperature=t, logprobs=k, top_k=10, repetition_penalty=1.5,
                             frequency_penalty=0.5, seed=s)
              for t, k, s in zip([0.8, 0.0, 1.0, 1.5, 0.0, 0.5], ks, [1, None, 2, None, 3, 4])]
    logits = seeded_logits(15, len(params), vocab)
    rows = [make_row(p, device, [1, 2, 3], [4, 5, 5]) for p in params]
    out = Sampler(device, 0).sample(logits.to(device), rows)
    entries = host_logprobs(out, len(rows))
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, (k, entry) in enumerate(zip(ks, entries)):
        if k is None:
            assert entry is None
            continue
        chosen = int(out.token_ids[i])
        top = reference[i].topk(k)
        assert entry.token_ids == [chosen] + top.indices.tolist()
        torch.testing.assert_close(torch.tensor(entry.logprobs, dtype=torch.float64),
                                   torch.cat([reference[i, chosen:chosen + 1], top.values]),
                                   rtol=1e-5, atol=1e-5)
        assert entry.rank == 1 + int((reference[i] > reference[i, chosen]).sum())
    # The greedy row's penalties spare the raw favourite, so it is chosen and ranks first.
    assert entries[1].rank == 1 and len(entries[1].token_ids) == ks[1] + 1


def test_greedy_logprobs_of_one_read_equal_the_general_paths(device: torch.device) -> None:
    """Greedy rows asking for logprobs 0, 1, 5 or none, on tied logits under a grammar
    mask, take their tokens and logprobs from one read of the logits: every row in the
    packed block, the ones that asked for none at width 0. Tokens, ids, ranks and logprobs
    are the general path's, which a row with a penalty still takes."""
    ks = [1, None, 0, 5, None]
    logits = tied_logits(31, len(ks), 300).to(device)
    bitmask = torch.full((1, 10), -1, dtype=torch.int32, device=device)
    bitmask[0, :4] = 0  # row 3 may not take its first 128 tokens
    mask = GrammarMask(bitmask, torch.tensor([3], device=device))
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=k), device) for k in ks]
    out = Sampler(device, 0).sample(logits.clone(), rows, mask)
    assert out.logprobs is not None and out.logprobs.rows == list(range(len(ks)))
    assert out.logprobs.widths == [2, 0, 1, 6, 0]
    masked = logits.clone()
    masked[3, :128] = float("-inf")
    assert torch.equal(out.token_ids, masked.argmax(dim=-1))
    assert_same_logprobs(host_logprobs(out, len(ks)),
                         reference_token_logprobs(masked, out.token_ids, rows))
    wider = rows + [make_row(SamplingParams(temperature=0.0, logprobs=2,
                                            repetition_penalty=1.5), device)]
    general = Sampler(device, 0).sample(torch.cat([masked, logits[:1]]), wider)
    assert general.logprobs is not None and general.logprobs.rows == [0, 2, 3, 5]
    assert_same_logprobs(host_logprobs(general, len(wider))[:len(ks)],
                         host_logprobs(out, len(ks)))


def test_a_graph_head_samples_greedy_rows_on_raw_logits_at_the_narrowest_width() -> None:
    def head(*params: SamplingParams) -> int | None:
        return graph_head([make_row(p, torch.device("cpu")) for p in params])
    def logprobs(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, logprobs=n)
    greedy = SamplingParams(temperature=0.0)
    assert head(greedy, greedy) == 0
    assert head(greedy, logprobs(0)) == 1
    assert head(logprobs(1), greedy) == 1
    assert head(greedy, logprobs(2)) == head(logprobs(5), logprobs(1)) == 5
    assert head(logprobs(6), greedy) == head(logprobs(0), logprobs(20)) == 20
    assert head(greedy, logprobs(21)) is None
    assert head(greedy, SamplingParams(temperature=0.7)) is None
    assert head(greedy, SamplingParams(temperature=0.0, repetition_penalty=1.2)) is None
    assert head(SamplingParams(temperature=0.0, logit_bias={3: 1.0})) is None


def test_a_rows_path_follows_its_outputs_past_min_tokens() -> None:
    """A row's params are read once (SamplingRow), its outputs at each step: EOS is held
    back, which the graph heads cannot do, only until min_tokens are out; a grammar holds
    nothing back (services/worker/grammar.py ends the request at its EOS)."""
    outputs: list[int] = []  # the request's own list, which the row reads
    row = SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), [1], outputs, None)
    assert graph_head([row]) is None
    outputs += [5, 6]
    assert graph_head([row]) == 0
    grammar = SamplingParams(temperature=0.0, min_tokens=2,
                             structured_outputs={"json": {"type": "object"}})
    assert graph_head([make_row(grammar, torch.device("cpu"))]) == 0


@pytest.mark.parametrize("k", GRAPH_HEADS)
def test_a_graph_heads_padded_output_reads_as_the_samplers(device: torch.device,
                                                           k: int) -> None:
    """A head samples every row of its graph, the padding rows after the step's too: the
    step's rows read back from its one copy as the sampler's output for them alone, rows
    of logprobs 0, 1, none and the most, narrower than the head's k past k = 1 (a head
    serves every width up to its own), side by side."""
    logprobs = [0, None, max(k - 3, 1), 1, None] if k else [None] * 5
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=n), device) for n in logprobs]
    logits = tied_logits(12, 8, 300).to(device)
    logits[len(rows):] = 0.0  # padding: what an earlier step left in the graph's buffers
    assert graph_head(rows) == k
    out = graph_head_output(greedy_head(logits, k), rows, k)
    want = Sampler(device, 0).sample(logits[:len(rows)].clone(), rows)
    assert torch.equal(out.token_ids, want.token_ids)
    assert (out.logprobs is None) == (want.logprobs is None) == (k == 0)
    if k:
        assert out.logprobs is not None and out.logprobs.padding == 3
        assert host_logprobs(out, len(rows)) == host_logprobs(want, len(rows))


@pytest.mark.parametrize("k", [0, 4])
def test_prompt_logprobs_shapes_values_and_ranks(device: torch.device, k: int) -> None:
    num_positions, vocab = 9, 40
    logits = tied_logits(16, num_positions, vocab)
    targets = torch.randint(0, vocab, (num_positions,),
                            generator=torch.Generator().manual_seed(16))
    ids, values, ranks = prompt_logprobs(logits.to(device), targets.to(device), k)
    assert ids.shape == values.shape == (num_positions, k + 1)
    assert ranks.shape == (num_positions,)
    reference = torch.log_softmax(logits.double(), dim=-1)
    ids, values, ranks = ids.cpu(), values.cpu().double(), ranks.cpu()
    assert torch.equal(ids[:, 0], targets)
    # With ties the top-k ids are not unique, but their logprobs are.
    torch.testing.assert_close(values, reference.gather(1, ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values[:, 1:], reference.topk(k).values, rtol=1e-5, atol=1e-5)
    naive = [1 + sum(x > row[t] for x in row) for row, t in zip(reference.tolist(),
                                                                 targets.tolist())]
    assert ranks.tolist() == naive


# --- the GPU path ----------------------------------------------------------------------------------

def test_mixed_batch_samples_without_a_device_sync(device: torch.device) -> None:
    logits = seeded_logits(17, 7, 128).to(device)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3),
              SamplingParams(temperature=1.0, min_p=0.2, min_tokens=3, eos_token_ids=(2,)),
              SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.1, top_p=0.5),
              SamplingParams(temperature=0.7, allowed_token_ids=[3, 9, 40],
                             logit_bias={9: 3.0})]
    rows = [make_row(p, device, [5, 6, 7], [8, 9]) for p in params]
    sampler = Sampler(device, 0)
    with forbid_syncs(device):
        out = sampler.sample(logits, rows)
    tokens = out.token_ids.tolist()
    assert tokens[4] == int(logits[4].argmax())
    assert tokens[2] != 2 and tokens[6] in (3, 9, 40)


# --- top-k and top-p without a sort, against the sorted twins --------------------------------

def sorted_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The sampler's former top-p, kept as the twin: a full sort and a cumulative sum."""
    ordered = probs.sort(dim=-1, descending=True).values
    before = (ordered.cumsum(dim=-1) < top_p.unsqueeze(1)).sum(dim=-1)
    num_kept = torch.where(top_p < 1.0, before + 1, ordered.shape[1]).clamp_max(
        ordered.shape[1])
    return probs.masked_fill(probs < ordered.gather(1, (num_kept - 1).unsqueeze(1)), 0.0)


def test_top_p_search_equals_the_sorted_twin(device: torch.device) -> None:
    """Random logits with many exact ties, a few dropped (-inf) tokens, and per-row top_p
    across (0, 1], 1 included: the same probabilities, bit for bit."""
    rng = random.Random(19)
    for vocab, scale in ((37, 2.0), (3000, 4.0), (3000, 0.3)):
        logits = torch.round(seeded_logits(vocab, 48, vocab, scale) * 2) / 2
        logits[::5, :vocab // 3] = float("-inf")
        probs = torch.softmax(logits, dim=-1).to(device)
        ps = torch.tensor([rng.choice([1e-6, 0.05, 0.3, 0.5, 0.8, 0.95, 0.999, 1.0])
                           for _ in range(48)], device=device)
        assert torch.equal(apply_top_p(probs, ps), sorted_top_p(probs, ps))


def test_top_p_of_a_few_rows_equals_the_search_over_many(device: torch.device) -> None:
    """A batch of up to RADIX_TOP_P_ROWS takes the radix select, a larger one the search:
    the same tokens stay either way, ties and dropped tokens included."""
    rng = random.Random(21)
    logits = torch.round(seeded_logits(3000, 48, 3000, 3.0) * 2) / 2
    logits[::5, :1000] = float("-inf")
    probs = torch.softmax(logits, dim=-1).to(device)
    ps = torch.tensor([rng.choice([1e-6, 0.3, 0.8, 0.95, 1.0]) for _ in range(48)],
                      device=device)
    copies = RADIX_TOP_P_ROWS // 48 + 1
    many = apply_top_p(probs.repeat(copies, 1), ps.repeat(copies))
    assert torch.equal(apply_top_p(probs, ps), many[:48])


def test_top_p_search_keeps_ties_at_the_edge(device: torch.device) -> None:
    # 0.25 x 4: top_p 0.3 reaches its mass with the second token, and the other two tie
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.2, 0.2, 0.1]], device=device)
    kept = apply_top_p(probs, torch.tensor([0.3, 0.55], device=device))
    assert torch.equal(kept, probs.masked_fill(torch.tensor([[False] * 4,
                                                             [False, False, False, True]],
                                                            device=device), 0.0))


def test_sampled_tokens_equal_the_sorted_twins_under_the_same_noise(device: torch.device
                                                                     ) -> None:
    """The sampler's distribution (top_k=0 rows take the search) against the sorted twin,
    and the tokens both give under the same exponential draws."""
    rng = random.Random(20)
    num_rows, vocab = 16, 2000
    params = [SamplingParams(temperature=rng.choice([0.5, 1.0, 1.5]),
                             top_p=rng.choice([0.2, 0.7, 0.9, 1.0]),
                             top_k=rng.choice([0, 0, 5, 1]), seed=i) for i in range(num_rows)]
    rows = [make_row(p, device) for p in params]
    logits = tied_logits(20, num_rows, vocab).to(device)
    sampler = Sampler(device, 0)
    probs = sampler.probs(logits, rows)
    scaled = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    top_k = torch.tensor([p.top_k for p in params], device=device)
    twin = sorted_top_p(torch.softmax(apply_top_k(scaled, top_k, 5), dim=-1),
                        torch.tensor([p.top_p for p in params], device=device))
    assert torch.equal(probs, twin)
    # the same draws as the sampler's: fresh generators of the same seeds
    noise = Sampler(device, 0).exponential_noise(probs, [make_row(p, device) for p in params])
    tokens = sampler.sample(logits.clone(), rows).token_ids
    assert torch.equal(tokens, (twin / noise).argmax(dim=-1))
    assert torch.equal(tokens[[i for i, p in enumerate(params) if p.top_k == 1]],
                       logits[[i for i, p in enumerate(params) if p.top_k == 1]].argmax(-1))


def test_top_k_search_equals_topk(device: torch.device) -> None:
    """Past TOP_K_BOUND the k-th largest logit comes from a search: ties, -inf, negative
    and positive logits, k of 1, a middle one, the vocabulary and past it."""
    vocab = 3000
    logits = tied_logits(21, 12, vocab)
    logits[3, 100:] = float("-inf")
    logits[4] -= 50.0
    ks = torch.tensor([1, 2, 7, 1500, 2999, 3000, 2000, 1025, 1, 2500, 50, 600])
    kth = top_k_threshold(logits.to(device), ks.to(device)).cpu()
    expected = logits.topk(vocab, dim=-1).values.gather(1, (ks - 1).unsqueeze(1))[:, 0]
    assert torch.equal(kth, expected)
    wide = torch.tensor([0, 1, 5000, 2999, 1500, 3000, 2, 1025, 7, 2500, 50, 1100])
    kept = apply_top_k(logits.to(device), wide.to(device), 5000).cpu()
    # the k-th largest by a full sort; k = 0 or past the vocabulary keeps every logit
    kth = logits.sort(dim=-1, descending=True).values.gather(
        1, (wide.clamp(1, vocab) - 1).unsqueeze(1))
    kth[(wide == 0) | (wide >= vocab)] = float("-inf")
    assert torch.equal(kept, logits.masked_fill(logits < kth, float("-inf")))
    assert (torch.isfinite(kept).sum(dim=-1) > wide.clamp(1, vocab)).any()  # ties at the k-th


# --- logprobs in one copy with the tokens --------------------------------------------------------

def reference_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                             rows: Sequence[SamplingRow]) -> list[TokenLogprobs | None]:
    """The former path, kept as the twin: the wanted rows' top-k read back on their own
    (three copies that waited for the device), entry by entry; among equal logits the
    lower column first, as the sampler's one read takes them (topk's order is its own)."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    k = max(rows[i].params.logprobs for i in wanted)
    logprobs = torch.log_softmax(logits[wanted].float(), dim=-1)
    ids, values, ranks = top_logprobs(logprobs, tokens[wanted], k)
    order = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices[:, :k]
    ids[:, 1:], values[:, 1:] = order, logprobs.gather(1, order)
    out: list[TokenLogprobs | None] = [None] * len(rows)
    for j, i in enumerate(wanted):
        width = rows[i].params.logprobs + 1
        out[i] = TokenLogprobs(ids.tolist()[j][:width], values.tolist()[j][:width],
                               ranks.tolist()[j])
    return out


@pytest.mark.parametrize("ks", [[0, 1, 5, None, 1, 0, 5, None], [5] * 8, [None] * 7 + [0]])
def test_packed_logprobs_equal_the_former_path(device: torch.device,
                                               ks: list[int | None]) -> None:
    """Greedy and sampled rows, seeded and not, logprobs 0, 1 and 5 (and none) mixed."""
    params = [SamplingParams(temperature=t, logprobs=k, top_p=p, seed=s)
              for t, k, p, s in zip([0.0, 0.8, 0.0, 1.0, 1.2, 0.0, 0.7, 0.0], ks,
                                    [1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0],
                                    [None, 1, None, None, 2, None, None, None])]
    logits = tied_logits(22, len(params), 500).to(device)
    rows = [make_row(p, device) for p in params]
    out = Sampler(device, 5).sample(logits.clone(), rows)
    packed = out.packed.cpu()
    assert torch.equal(packed[:len(rows)], out.token_ids.cpu())
    assert_same_logprobs(host_logprobs(out, len(rows)),
                         reference_token_logprobs(logits, out.token_ids, rows))


def assert_same_logprobs(got: list[TokenLogprobs | None],
                         want: list[TokenLogprobs | None]) -> None:
    """The same rows, ids and ranks, and logprobs to float32's rounding: on CUDA one pass a
    row sums the row in its own order where logprobs ask for one token at most."""
    assert [lp and (lp.token_ids, lp.rank) for lp in got] == \
        [lp and (lp.token_ids, lp.rank) for lp in want]
    for lp, ref in zip(got, want):
        assert lp is None or lp.logprobs == pytest.approx(ref.logprobs, rel=1e-5, abs=1e-5)


def test_logprobs_sample_without_a_device_sync(device: torch.device) -> None:
    logits = seeded_logits(23, 4, 3000).to(device)
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.9, top_p=0.8, logprobs=1),
              SamplingParams(temperature=1.0, top_p=0.6, top_k=2000),
              SamplingParams(temperature=0.8, top_p=0.95, seed=4, logprobs=0)]
    rows = [make_row(p, device) for p in params]
    with forbid_syncs(device):
        packed = Sampler(device, 0).sample(logits, rows).packed
    # the tokens, then 3 rows of 6 ids and 6 values, then 3 ranks: one fixed-width copy
    assert packed.shape == (4 + 3 * 6 * 2 + 3,)

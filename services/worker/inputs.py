"""A step's inputs: the plan's requests laid end to end, as the model reads them.

Request i computes num_scheduled_tokens[i] tokens from position num_computed_tokens[i];
the batch holds them request after request (query_start_loc: where each begins), each
token with its position and its KV cache slot, block_table[i][position // block_size] *
block_size + position % block_size. A speculating request's tokens end with its drafts.
A decode input whose token the step in flight sampled is not on the host yet: it is a
placeholder that the device fills in from that step's samples (`gathers`), so the host
prepares this step without waiting for the last. A request samples when the step reaches
its last token (the pending one counted), an embedding request never; one with drafts
verifies them at its 1 + k last positions instead (services/worker/spec_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.messages import StepPlan
from common.speculative import split_drafts
from services.worker.block_table import BlockTable
from services.worker.cuda_graphs import GraphKey
from services.worker.layers.attention import AttentionMetadata
from services.worker.request_state import RequestState


@dataclass(slots=True)
class FlatBatch:
    """The host side of a step's inputs (numpy), before they go to the device."""
    token_ids: np.ndarray  # int64 [tokens]; 0 where `gathers` fills one in on the device
    gathers: list[tuple[int, int]]  # (token index, row of the previous step's samples)
    positions: np.ndarray  # int64 [tokens]
    slot_mapping: np.ndarray  # int64 [tokens]: each token's KV cache slot
    block_table: np.ndarray  # int32 [requests, most blocks of one], zero-padded
    query_start_loc: np.ndarray  # int64 [requests + 1]: each request's first token index
    num_computed: np.ndarray  # int64 [requests]: each request's first position
    num_scheduled: np.ndarray  # int64 [requests]
    seq_lens: np.ndarray  # int64 [requests]: context length after this step
    drafts: list[list[int]]  # each request's drafts, the last len(drafts[i]) of its tokens
    reach_at: np.ndarray  # int64 [requests]: its known tokens plus the pending one
    # the rows that ask for prompt logprobs or pool: most steps have none to look at
    special: list[int]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    sample_indices: torch.Tensor  # token index of each sampling request's last token
    seq_lens: np.ndarray  # each request's context length after this step
    sampling: list[RequestState]
    sample_rows: list[int]  # batch rows of `sampling`
    prompt_logprob_rows: list[tuple[RequestState, int, int, int]]
    # (state, first token index in the batch, first position, count) per prompt-logprob chunk
    pooling_rows: list[tuple[RequestState, int, int, bool]]
    # (state, first token index in the batch, count, its prompt's last chunk) per embedding
    spec: list[tuple[RequestState, list[int]]]  # with drafts
    spec_rows: list[int]  # batch rows of `spec`
    spec_indices: torch.Tensor | None  # their 1 + k token indices each, in order
    # a vision-language step's (token indices, image embedding rows) (services/worker/
    # images.py); its positions are then [3, T]
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    graph: GraphKey | None = None  # the step graph that replayed it (cuda_graphs.py)


def prepare_inputs(plan: StepPlan, states: list[RequestState], table: BlockTable,
                   block_size: int, last_tokens: torch.Tensor, device: torch.device
                   ) -> StepInputs:
    """The inputs of `plan`, whose requests are `states`, their blocks in `table`;
    last_tokens: the samples of the step in flight, on the device."""
    batch = flatten(plan, states, table, block_size)
    samples, spec = sampling_rows(states, batch)
    gathers = np.asarray(batch.gathers, dtype=np.int64).reshape(-1, 2).T
    (input_ids, positions, sample_indices, slot_mapping, block_tables, query_start_loc,
     seq_lens, gather_to, gather_from, spec_indices) = to_device_together([
        batch.token_ids, batch.positions, batch.query_start_loc[1:][samples] - 1,
        batch.slot_mapping, batch.block_table, batch.query_start_loc.astype(np.int32),
        batch.seq_lens.astype(np.int32), gathers[0], gathers[1],
        _spec_indices(batch, spec)], device)
    if batch.gathers:
        input_ids[gather_to] = last_tokens[gather_from]
    attn = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                             query_start_loc=query_start_loc, seq_lens=seq_lens,
                             max_query_len=int(batch.num_scheduled.max()),
                             max_seq_len=int(batch.seq_lens.max()))
    return StepInputs(
        input_ids=input_ids, positions=positions, attn=attn, sample_indices=sample_indices,
        seq_lens=batch.seq_lens,
        sampling=[states[i] for i in samples], sample_rows=samples,
        prompt_logprob_rows=prompt_logprob_rows(states, batch),
        pooling_rows=pooling_rows(states, batch),
        spec=[(states[i], batch.drafts[i]) for i in spec], spec_rows=spec,
        spec_indices=spec_indices if spec else None)


def flatten(plan: StepPlan, states: list[RequestState], table: BlockTable, block_size: int
            ) -> FlatBatch:
    num_scheduled = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
    starts = np.asarray(plan.num_computed_tokens, dtype=np.int64)
    cu = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=cu[1:])
    positions = np.arange(cu[-1]) + np.repeat(starts - cu[:-1], num_scheduled)
    drafts = split_drafts(plan.num_draft_tokens, plan.draft_token_ids, len(states))
    rows = _rows(states, starts, num_scheduled, drafts)
    blocks = table.gather(np.asarray(rows.table_rows, dtype=np.int64))
    return FlatBatch(np.asarray(rows.token_ids, dtype=np.int64), rows.gathers, positions,
                     slot_mapping(blocks, positions, num_scheduled, block_size), blocks, cu,
                     starts, num_scheduled, starts + num_scheduled, drafts,
                     np.asarray(rows.reach_at, dtype=np.int64), rows.special)


@dataclass(slots=True)
class _Rows:
    """What the step reads of each request, gathered in one pass: a 256-row step's six
    passes (one a property) took 338 us of the 2-CPU box's prepare_inputs."""
    token_ids: list[int]
    gathers: list[tuple[int, int]]
    table_rows: list[int]
    reach_at: list[int]
    special: list[int]


def _rows(states: list[RequestState], starts: np.ndarray, num_scheduled: np.ndarray,
          drafts: list[list[int]]) -> _Rows:
    """Each request's scheduled tokens, its drafts last, and the placeholders to gather;
    its block table row, the tokens it reaches, and whether it is special (FlatBatch). A
    decode whose token is still in flight knows none of its tokens: it slices nothing,
    which at 256 such rows took the tokens from 134 to 48 us on the 2-CPU box."""
    rows = _Rows([], [], [], [], [])
    token_ids, gathers = rows.token_ids, rows.gathers
    table_row, reach_at = rows.table_rows.append, rows.reach_at.append
    for i, (state, start, n, draft) in enumerate(zip(states, starts.tolist(),
                                                     num_scheduled.tolist(), drafts)):
        end = start + n - len(draft)
        known = len(state.prompt_ids) + len(state.output_ids)
        if start < known:
            token_ids += state.tokens(start, min(end, known))
        if known < end:  # the token sampled by the step still in flight
            assert state.pending == 1 and known + 1 == end, "one token ahead at most"
            gathers.append((len(token_ids), state.sample_row))
            token_ids.append(0)
        if draft:
            token_ids += draft
        table_row(state.table_row)
        reach_at(known + state.pending)
        if state.special:
            rows.special.append(i)
    return rows


def slot_mapping(table: np.ndarray, positions: np.ndarray, num_scheduled: np.ndarray,
                 block_size: int) -> np.ndarray:
    req_of_token = np.repeat(np.arange(len(table)), num_scheduled)
    return (table[req_of_token, positions // block_size].astype(np.int64) * block_size
            + positions % block_size)


def sampling_rows(states: list[RequestState], batch: FlatBatch
                  ) -> tuple[list[int], list[int]]:
    """The rows that sample a token, and the rows that verify their drafts instead: those
    whose step reaches their last token, the pending one counted (an embedding never
    samples)."""
    num_drafts = np.fromiter(map(len, batch.drafts), np.int64, len(states))
    reach = batch.seq_lens - num_drafts == batch.reach_at
    for i in batch.special:
        reach[i] &= not states[i].embed
    rows = np.flatnonzero(reach)
    drafted = num_drafts[rows] > 0
    return rows[~drafted].tolist(), rows[drafted].tolist()


def prompt_logprob_rows(states: list[RequestState], batch: FlatBatch
                        ) -> list[tuple[RequestState, int, int, int]]:
    rows = []
    for i in batch.special:
        state = states[i]
        if state.params.prompt_logprobs is None:
            continue
        start = int(batch.num_computed[i])
        # the last prompt token predicts output, not a prompt token
        end = min(start + int(batch.num_scheduled[i]), len(state.prompt_ids) - 1)
        if end > start:
            rows.append((state, int(batch.query_start_loc[i]), start, end - start))
    return rows


def pooling_rows(states: list[RequestState], batch: FlatBatch
                 ) -> list[tuple[RequestState, int, int, bool]]:
    return [(states[i], int(batch.query_start_loc[i]), int(batch.num_scheduled[i]),
             bool(batch.seq_lens[i] == states[i].num_tokens))
            for i in batch.special if states[i].embed]


def _spec_indices(batch: FlatBatch, spec: list[int]) -> np.ndarray:
    """The token indices of each speculating row's last token and its drafts."""
    ends = batch.query_start_loc[1:]
    return np.concatenate([np.arange(ends[i] - 1 - len(batch.drafts[i]), ends[i])
                           for i in spec] or [np.zeros(0, dtype=np.int64)])


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}  # 8-byte first


def to_device_together(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays (int64 or int32) on `device` after one copy, from pageable memory, which
    the driver stages at once without waiting for the queued steps. One byte buffer holds
    them all, the int64 ones first, and each dtype's run comes back split into the arrays'
    views in one call: at batch 1 every torch call costs the host microseconds. On an
    H200's host this took 57 us a step where the nine arrays' own copies took 68; the
    copy itself is 18 of them, the views the rest (benchmarks/gpu/input_copies.py,
    issue 31)."""
    runs = [[i for i, array in enumerate(arrays) if array.dtype == dtype]
            for dtype in _TORCH_DTYPES]
    order = [i for run in runs for i in run]
    assert len(order) == len(arrays), "only int64 and int32 arrays go together"
    flat = np.concatenate([np.ascontiguousarray(arrays[i]).reshape(-1).view(np.uint8)
                           for i in order])
    moved = torch.from_numpy(flat).to(device, non_blocking=True)
    out = [moved] * len(arrays)
    start = 0
    for (dtype, torch_dtype), run in zip(_TORCH_DTYPES.items(), runs):
        sizes = [arrays[i].size for i in run]
        nbytes = sum(sizes) * dtype.itemsize
        parts = moved[start:start + nbytes].view(torch_dtype).split(sizes)
        for i, part in zip(run, parts):
            out[i] = part if arrays[i].ndim == 1 else part.view(arrays[i].shape)
        start += nbytes
    return out

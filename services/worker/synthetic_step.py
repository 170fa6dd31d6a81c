"""A decode step made up for timing the host's side of it (`headrace bench inputs`): every
row's token still in flight, as the step thread sees a decode step while the one before
runs, contexts of 32 to 159 tokens, greedy."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.messages import StepPlan
from common.sampling_params import SamplingParams
from services.worker.block_table import BlockTable
from services.worker.inputs import StepInputs, prepare_inputs
from services.worker.request_state import RequestState

BLOCK_SIZE = 16
PROMPT_LEN = 32


def decode_step(rows: int, logprobs: int | None) -> tuple[StepPlan, list[RequestState],
                                                         BlockTable]:
    """A plan of `rows` one-token decodes whose last token is pending, and their states."""
    table = BlockTable(rows=rows, width=16)
    params = SamplingParams(temperature=0.0, logprobs=logprobs)
    states = []
    for i in range(rows):
        context = PROMPT_LEN + i % 128
        blocks = list(range(i * 16, i * 16 + context // BLOCK_SIZE + 1))
        states.append(RequestState(f"r{i}", list(range(PROMPT_LEN)),
                                   list(range(context - PROMPT_LEN)), table.add(blocks),
                                   params, None, pending=1, sample_row=i))
    plan = StepPlan(step=1, req_ids=[s.req_id for s in states],
                    num_scheduled_tokens=[1] * rows,
                    num_computed_tokens=[s.num_tokens for s in states])
    return plan, states, table


def decode_step_preparer(rows: int, logprobs: int | None) -> Callable[[], StepInputs]:
    """A call prepares decode_step's inputs on the CPU, the step before's samples being
    rows 0..rows-1 of a tensor of ids."""
    plan, states, table = decode_step(rows, logprobs)
    last_tokens = torch.arange(rows, dtype=torch.int64)
    cpu = torch.device("cpu")
    return lambda: prepare_inputs(plan, states, table, BLOCK_SIZE, last_tokens, cpu)

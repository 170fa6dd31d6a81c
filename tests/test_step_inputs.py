"""A step's inputs (services/worker/inputs.py) against values worked out by hand: the
plan's requests end to end, each token's position and KV cache slot, the block tables,
and which rows sample, verify drafts, take prompt logprobs or pool."""

import numpy as np
import pytest
import torch

from common.messages import StepPlan
from common.sampling_params import SamplingParams
from services.worker.block_table import BlockTable
from services.worker.inputs import flatten, prepare_inputs, to_device_together
from services.worker.request_state import RequestState

BLOCK_SIZE = 4
TABLE = BlockTable(rows=2, width=2)  # every test's requests; small, so that it grows
CPU = torch.device("cpu")
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def state(req_id: str, prompt: list[int], output: list[int], blocks: list[int],
          params: SamplingParams | None = None, **extra) -> RequestState:
    return RequestState(req_id, prompt, output, TABLE.add(blocks), params or SamplingParams(),
                        None, **extra)


def chunked_prefill_and_two_decodes() -> tuple[StepPlan, list[RequestState]]:
    # a: a 10-token prompt, this step its second chunk: positions 4..7 (of 10)
    a = state("a", list(range(100, 110)), [], [7, 3, 9],
              SamplingParams(prompt_logprobs=1))
    # b: 5 prompt tokens and 2 outputs on the host, decoding its last output at 6
    b = state("b", [1, 2, 3, 4, 5], [60, 61], [2, 5])
    # c: its 3-token prompt done, its first output still in flight (row 1 of those samples)
    c = state("c", [7, 8, 9], [], [4], pending=1, sample_row=1)
    plan = StepPlan(step=3, req_ids=["a", "b", "c"], num_scheduled_tokens=[4, 1, 1],
                    num_computed_tokens=[4, 6, 3])
    return plan, [a, b, c]


def test_a_chunked_prefill_and_two_decodes_flatten_by_hand():
    plan, states = chunked_prefill_and_two_decodes()
    batch = flatten(plan, states, TABLE, BLOCK_SIZE)
    assert batch.token_ids.tolist() == [104, 105, 106, 107, 61, 0]  # c's: a placeholder
    assert batch.gathers == [(5, 1)]  # filled from the in-flight step's row 1
    assert batch.positions.tolist() == [4, 5, 6, 7, 6, 3]
    # a's positions 4..7 are its second block (3): slots 12..15; b's position 6 is
    # offset 2 of its second block (5): 22; c's position 3 is offset 3 of block 4: 19
    assert batch.slot_mapping.tolist() == [12, 13, 14, 15, 22, 19]
    assert batch.block_table.tolist() == [[7, 3, 9], [2, 5, 0], [4, 0, 0]]
    assert batch.block_table.dtype == np.int32
    assert batch.query_start_loc.tolist() == [0, 4, 5, 6]
    assert batch.seq_lens.tolist() == [8, 7, 4]


def test_the_decodes_sample_and_the_chunk_takes_prompt_logprobs():
    plan, states = chunked_prefill_and_two_decodes()
    a, b, c = states
    last_tokens = torch.tensor([50, 51])  # the in-flight step's samples, on the device
    inputs = prepare_inputs(plan, states, TABLE, BLOCK_SIZE, last_tokens, CPU)
    assert inputs.input_ids.tolist() == [104, 105, 106, 107, 61, 51]
    assert inputs.positions.tolist() == [4, 5, 6, 7, 6, 3]
    attn = inputs.attn
    assert attn.slot_mapping.tolist() == [12, 13, 14, 15, 22, 19]
    assert attn.block_tables.tolist() == [[7, 3, 9], [2, 5, 0], [4, 0, 0]]
    assert attn.query_start_loc.tolist() == [0, 4, 5, 6]
    assert attn.seq_lens.tolist() == [8, 7, 4]
    assert (attn.max_query_len, attn.max_seq_len) == (4, 8)
    # a stops short of its prompt's end; b reaches its 7 tokens, c its 3 plus the pending
    assert inputs.sampling == [b, c] and inputs.sample_rows == [1, 2]
    assert inputs.sample_indices.tolist() == [4, 5]
    # a's chunk: tokens 0..3 of the batch, positions 4..7, each predicting the next prompt
    # token (position 8 predicts 9, still a prompt token)
    assert inputs.prompt_logprob_rows == [(a, 0, 4, 4)]
    assert inputs.spec == [] and inputs.spec_indices is None and inputs.pooling_rows == []


def test_a_prompts_last_chunk_stops_its_prompt_logprobs_before_the_last_token():
    a = state("a", list(range(100, 110)), [], [7, 3, 9], SamplingParams(prompt_logprobs=2))
    plan = StepPlan(step=0, req_ids=["a"], num_scheduled_tokens=[2],
                    num_computed_tokens=[8])
    inputs = prepare_inputs(plan, [a], TABLE, BLOCK_SIZE, torch.empty(0, dtype=torch.int64), CPU)
    # position 9 is the last prompt token: it predicts output, so one row, position 8
    assert inputs.prompt_logprob_rows == [(a, 0, 8, 1)]
    assert inputs.sampling == [a] and inputs.sample_indices.tolist() == [1]
    assert inputs.attn.slot_mapping.tolist() == [36, 37]  # block 9, offsets 0 and 1


def test_drafts_come_last_and_their_rows_verify_instead_of_sampling():
    # d: 4 prompt tokens and 1 output, its output at position 4 followed by drafts 31, 32
    d = state("d", [1, 2, 3, 4], [30], [6, 8])
    b = state("b", [1, 2, 3, 4, 5], [60, 61], [2, 5])
    plan = StepPlan(step=5, req_ids=["b", "d"], num_scheduled_tokens=[1, 3],
                    num_computed_tokens=[6, 4], num_draft_tokens=[0, 2],
                    draft_token_ids=[31, 32])
    inputs = prepare_inputs(plan, [b, d], TABLE, BLOCK_SIZE, torch.empty(0, dtype=torch.int64),
                            CPU)
    assert inputs.input_ids.tolist() == [61, 30, 31, 32]
    assert inputs.positions.tolist() == [6, 4, 5, 6]
    assert inputs.attn.slot_mapping.tolist() == [22, 32, 33, 34]  # d's second block: 8
    assert inputs.sampling == [b] and inputs.sample_indices.tolist() == [0]
    assert inputs.spec == [(d, [31, 32])] and inputs.spec_rows == [1]
    assert inputs.spec_indices.tolist() == [1, 2, 3]  # its last token, then its drafts
    assert inputs.seq_lens.tolist() == [7, 7]


def test_an_embedding_request_pools_every_chunk_and_never_samples():
    e = state("e", [5, 6, 7, 8, 9], [], [1, 2], embed=True)
    b = state("b", [1, 2, 3, 4, 5], [60, 61], [2, 5])
    for computed, scheduled, last in [(0, 3, False), (3, 2, True)]:
        plan = StepPlan(step=0, req_ids=["b", "e"], num_scheduled_tokens=[1, scheduled],
                        num_computed_tokens=[6, computed])
        inputs = prepare_inputs(plan, [b, e], TABLE, BLOCK_SIZE,
                                torch.empty(0, dtype=torch.int64), CPU)
        # (state, first token index in the batch, count, its prompt's last chunk)
        assert inputs.pooling_rows == [(e, 1, scheduled, last)]
        assert inputs.sampling == [b]


def together_cases() -> list[np.ndarray]:
    """int64 and int32, empty, 2-D, and a strided view (a transposed pair's row)."""
    pairs = np.asarray([[1, 2], [3, 4], [5, 6]], dtype=np.int64).T
    return [np.arange(5), np.zeros(0, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3),
            pairs[1], np.arange(3, dtype=np.int32)]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_arrays_copied_together_keep_their_values_dtypes_and_shapes(device: torch.device):
    arrays = together_cases()
    moved = to_device_together(arrays, device)
    assert [t.device.type for t in moved] == [device.type] * len(arrays)
    for array, tensor in zip(arrays, moved):
        assert tensor.dtype == torch.from_numpy(array).dtype
        assert tuple(tensor.shape) == array.shape and tensor.cpu().tolist() == array.tolist()
    moved[0][1] = 100  # each a view of its own bytes: writing one leaves the rest
    assert moved[3].cpu().tolist() == [2, 4, 6] and moved[0].cpu().tolist()[:3] == [0, 100, 2]


def test_a_requests_sampling_row_follows_its_tokens_and_min_tokens():
    """The row is made once, over the lists the request grows: it sees every token sampled
    since, and the history a step needs ends once min_tokens is reached (a penalty's
    never does)."""
    a = state("a", [1, 2], [], [0], SamplingParams(min_tokens=2))
    row = a.sampling_row()
    assert a.needs_history()
    a.output_ids += [5, 6]
    assert a.sampling_row() is row and list(row.output_token_ids) == [5, 6]
    assert not a.needs_history()
    assert state("b", [1], [7], [0], SamplingParams(presence_penalty=0.5)).needs_history()


def test_the_block_table_grows_pads_with_zeros_and_gives_an_ended_requests_row_clean():
    table = BlockTable(rows=2, width=2)
    a, b = table.add([5, 6]), table.add([7])
    c = table.add([1, 2, 3])  # a third row and a third column: both grow
    table.extend(b, [8, 9, 10])
    assert table.gather(np.asarray([c, a, b])).tolist() == [[1, 2, 3, 0], [5, 6, 0, 0],
                                                          [7, 8, 9, 10]]
    assert table.gather(np.asarray([a])).tolist() == [[5, 6]]  # as wide as its longest
    table.release(b)
    d = table.add([4])  # b's row again, with none of b's ids left in it
    assert d == b and table.gather(np.asarray([d, c])).tolist() == [[4, 0, 0], [1, 2, 3]]
    assert table.gather(np.asarray([d])).dtype == np.int32

"""A TokenBatch's columns: rows written from items (or the scheduler's fields) come back as
the same items across the wire, equal params travel once, and columns that do not fit
together are refused rather than read as other rows."""

from __future__ import annotations

import dataclasses

import pytest

from common.detok_window import detok_params
from common.messages import DetokExtras, DetokItem, MessageError, TokenLogprobs, decode, encode
from common.sampling_params import SamplingParams
from common.token_columns import TokenColumns, batch_items, token_batch


def items() -> list[DetokItem]:
    plain = detok_params(SamplingParams())
    stops = detok_params(SamplingParams(stop=["\n"], include_stop_str_in_output=True))
    own = [TokenLogprobs([5, 6], [-0.5, -1.0], 1)]
    return [
        DetokItem("a", 0, "g1", 0, [5], [1, 2, 3], 3, plain, 3, request_stamps=[1.5, 2.5],
                  num_cached_tokens=16, prompt_logprobs=[None, own[0]]),
        DetokItem("a", 1, "g1", 4, [7, 8], [1, 2, 3, 9, 9, 9, 9], 3, plain, 3),
        DetokItem("b", 0, "g2", 11, [], [4], 0, stops, 20, finish_reason="stop",
                  stop_reason="\n"),
        DetokItem("c", 0, "g2", 2, [9], [], 0, stops, 2, finish_reason="stop", stop_reason=9,
                  logprobs=own),
        DetokItem("e", 0, "g1", 0, [], [], 0, plain, 4, finish_reason="stop",
                  request_stamps=[3.0], embedding=b"\x00\x00\x80?")]


def test_items_come_back_whole_across_the_wire():
    sent = items()
    batch = decode(encode(token_batch(7, sent, stamps=[1.0, 2.0], shard=3)))
    assert (batch.step, batch.stamps, batch.shard) == (7, [1.0, 2.0], 3)
    assert batch_items(batch) == sent
    assert len(batch.params) == 2  # equal params are one object, sent once
    assert sorted(batch.extras) == [0, 2, 3, 4]  # row 1 carries nothing besides its tokens
    assert batch_items(decode(encode(token_batch(0, [])))) == []


def test_equal_params_are_one_object():
    assert detok_params(SamplingParams(stop=["x"])) is detok_params(SamplingParams(stop=["x"]))
    assert detok_params(SamplingParams(stop=["x"])) is not detok_params(SamplingParams())


def test_rows_of_logprobs_go_to_their_items():
    sent = items()[:3]
    row = TokenLogprobs([8], [-0.25], 2)
    got = batch_items(token_batch(0, sent), [None, row, None])
    assert [item.logprobs for item in got] == [[], [row], []]
    with pytest.raises(MessageError, match="logprobs for 2"):
        batch_items(token_batch(0, sent), [None, row])
    with pytest.raises(MessageError, match="of its own"):
        batch_items(token_batch(0, items()[3:4]), [row])


@pytest.mark.parametrize("change", [
    {"seqs": [0]},  # a column short
    {"new_ends": [1, 0, 3, 3, 3]},  # ends that run backwards
    {"context_ends": [3, 10, 12, 12, 12]},  # past the ids
    {"new_token_ids": [5, 7, 8, 9, 1]},  # ids past the last end
    {"params_of": [0, 0, 1, 2, 0]},  # params not in the batch
    {"extras": {9: DetokExtras()}},  # a row not in the batch
])
def test_columns_that_do_not_fit_are_refused(change):
    batch = dataclasses.replace(token_batch(0, items()), **change)
    with pytest.raises(MessageError):
        batch_items(decode(encode(batch)))


def test_a_scheduler_row_is_the_items_fields_in_order():
    """TokenColumns.append takes DetokItem's fields positionally: the scheduler's rows and
    the offline engine's items are one layout."""
    item = items()[0]
    fields = tuple(getattr(item, f.name) for f in dataclasses.fields(DetokItem))
    assert DetokItem(*fields) == item
    columns = TokenColumns()
    columns.append(*fields)
    assert batch_items(columns.batch(0)) == [item]

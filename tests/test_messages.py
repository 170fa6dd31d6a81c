"""The typed messages and their one codec: every registered message round-trips (property
tests whose values are drawn from each field's own type hint), token ids travel as packed
int32 bytes, and any bytes that are not a valid message raise MessageError and nothing
else, so a reader can always bury them in hr:dead and go on."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import messages
from common.hops import request_stages, step_stages
from common.messages import (_REGISTRY, DetokItem, DetokParams, MessageError, NewRequest,
                             ReplyBatch, StepLogprobs, StepPlan, StepResult, TextDelta,
                             TokenLogprobs, decode, encode, with_fields)
from common.sampling_params import RequestOutputKind, SamplingParams
from common.token_columns import batch_items, token_batch

INT32 = st.integers(-2**31, 2**31 - 1)
TEXT = st.text(max_size=12)
JSON_SCALAR = st.none() | st.booleans() | st.integers(-2**53, 2**53) | TEXT | st.floats(
    allow_nan=False)
PARAMS = st.sampled_from([
    SamplingParams(), SamplingParams(temperature=0.0, max_tokens=3),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=11, stop=["\n", "END"],
                   stop_token_ids=[2], logprobs=3, presence_penalty=0.5, n=2),
    SamplingParams(min_tokens=4, ignore_eos=True, prompt_logprobs=1, min_p=0.1),
    SamplingParams(logprobs=1, output_kind=RequestOutputKind.FINAL_ONLY)])


def strategy(hint: Any) -> st.SearchStrategy:
    """Values of a field's declared type, as the codec reads the hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:  # packed arrays
        if args[1].dtype.kind == "i":
            return st.lists(INT32, max_size=6)
        return st.lists(st.floats(width=32, allow_nan=False), max_size=6)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy(a) for a in args))
    if origin is list:
        return st.lists(strategy(args[0]), max_size=3)
    if origin is dict and args[0] is int:
        return st.dictionaries(st.integers(-2**63, 2**63 - 1), strategy(args[1]), max_size=3)
    if hint is dict or origin is dict:
        return st.dictionaries(TEXT, JSON_SCALAR, max_size=3)
    if hint is SamplingParams:
        return PARAMS
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint, include_extras=True)
        return st.builds(hint, **{f.name: strategy(hints[f.name])
                                  for f in dataclasses.fields(hint)})
    return {type(None): st.none(), bool: st.booleans(), str: TEXT,
            int: st.integers(-2**63, 2**63 - 1), float: st.floats(allow_nan=False),
            bytes: st.binary(max_size=16), Any: JSON_SCALAR}[hint]


ANY_MESSAGE = st.one_of(*(strategy(cls) for cls in _REGISTRY.values()))


@settings(max_examples=300, deadline=None)
@given(ANY_MESSAGE)
def test_every_message_round_trips(msg):
    data = messages.encode(msg)
    assert isinstance(data, bytes)
    assert messages.decode(data) == msg


@settings(max_examples=100, deadline=None)
@given(strategy(TextDelta), strategy(list[TokenLogprobs]))
def test_with_fields_copies_as_dataclasses_replace(delta, logprobs):
    """The offline engine's per-token copy: equal to replace's, the original untouched."""
    before = dataclasses.replace(delta)
    copy = with_fields(delta, logprobs=logprobs, text="changed")
    assert copy == dataclasses.replace(delta, logprobs=logprobs, text="changed")
    assert delta == before and copy is not delta
    with pytest.raises(TypeError, match="TextDelta has no field 'txt'"):
        with_fields(delta, txt="")


RECORDS = [v for v in vars(messages).values() if isinstance(v, type)
           and dataclasses.is_dataclass(v) and v.__module__ == messages.__name__]


def dataclass_twin(cls: type) -> type:
    """`cls` as dataclasses alone builds it: the reference for `record`'s __init__."""
    fields = {f.name: (f.default if f.default is not dataclasses.MISSING
                       else dataclasses.field(default_factory=f.default_factory))
              for f in dataclasses.fields(cls)
              if f.default is not dataclasses.MISSING
              or f.default_factory is not dataclasses.MISSING}
    namespace = {"__annotations__": typing.get_type_hints(cls, include_extras=True), **fields}
    return dataclasses.dataclass(frozen=True, slots=True)(type(cls.__name__, (), namespace))


@pytest.mark.parametrize("cls", RECORDS, ids=lambda cls: cls.__name__)
def test_a_records_init_builds_what_dataclasses_init_builds(cls):
    """record's __init__ sets the slots itself: by position or by name, every default
    and default factory as dataclasses' (a fresh list each), still frozen, and a missing
    or unknown argument still a TypeError."""
    twin = dataclass_twin(cls)
    required = [f for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    args = [object() for _ in required]
    by_name, by_place = cls(**{f.name: a for f, a in zip(required, args)}), cls(*args)
    want = twin(*args)
    for f in dataclasses.fields(cls):
        assert getattr(by_name, f.name) == getattr(want, f.name), f.name
        assert getattr(by_place, f.name) == getattr(want, f.name), f.name
        if f.default_factory is not dataclasses.MISSING:
            assert getattr(by_name, f.name) is not getattr(by_place, f.name)
    every = [object() for _ in dataclasses.fields(cls)]
    assert astuple(cls(*every)) == astuple(twin(*every))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(by_name, dataclasses.fields(cls)[0].name, None)
    if required:
        with pytest.raises(TypeError):
            cls(*args[:-1])
    with pytest.raises(TypeError):
        cls(*args, no_such_field=1)


def astuple(obj: Any) -> tuple:
    return tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))


def test_every_registered_message_is_covered():
    assert set(_REGISTRY) == {"generate", "admit", "abort", "error", "plan", "result",
                              "worker_ready", "worker_failed", "request_failed", "tokens",
                              "replies", "sched_stats", "routed", "response", "drain"}
    for tag, cls in _REGISTRY.items():
        assert cls.TYPE == tag and cls.VERSION >= 1
        assert dataclasses.fields(cls) and cls.__dataclass_params__.frozen


def test_token_ids_travel_as_packed_int32_bytes():
    plan = StepPlan(7, ["a", "b"], [1, 300], [0, 2**31 - 1])
    body = msgpack.unpackb(messages.encode(plan), raw=False)
    assert body["t"] == "plan" and body["v"] == 1
    assert body["num_scheduled_tokens"] == (1).to_bytes(4, "little") + (300).to_bytes(
        4, "little")
    assert len(body["num_computed_tokens"]) == 8


def test_a_steps_logprobs_travel_as_columns_and_come_apart_into_its_rows():
    """Rows 0 and 2 of three asked for logprobs (one and two entries), row 1 for none: four
    packed arrays on the wire, a TokenLogprobs or None a row out of rows()."""
    columns = StepLogprobs([1, 0, 2], [7, 9, 4], [-0.5, -0.25, -2.0], [1, 3])
    result = decode(encode(StepResult(3, ["a", "b", "c"], [7, 8, 9], columns)))
    assert result.logprobs == columns
    assert [type(v) for v in msgpack.unpackb(encode(result))["logprobs"].values()] == [bytes] * 4
    assert columns.rows() == [TokenLogprobs([7], [-0.5], 1), None,
                              TokenLogprobs([9, 4], [-0.25, -2.0], 3)]
    texted = with_fields(columns, texts=["a", "b", "c"])
    assert decode(encode(StepResult(3, ["a", "b", "c"], [7, 8, 9], texted))).logprobs == texted
    assert [row and row.texts for row in texted.rows()] == [["a"], None, ["b", "c"]]


def test_selected_rows_are_those_rows_in_that_order():
    """select: the rows asked for, reordered, repeated, -1 and width-0 rows empty; all of
    them in order is the columns themselves; columns that disagree are refused."""
    columns = StepLogprobs([1, 0, 2], [7, 9, 4], [-0.5, -0.25, -2.0], [1, 3], ["a", "b", "c"])
    rows = columns.rows()
    picked = columns.select([2, -1, 0, 1, 2])
    assert picked.rows() == [rows[2], None, rows[0], None, rows[2]]
    assert picked.widths == [2, 0, 1, 0, 2] and picked.ranks == [3, 1, 3]
    assert columns.select([0, 1, 2]) is columns
    assert columns.select([]).rows() == []
    with pytest.raises(MessageError, match="do not match"):
        StepLogprobs([1, 2], [7], [-0.5], [1, 2]).select([1])


@pytest.mark.parametrize("columns", [
    StepLogprobs([1, 0, 2], [7, 9], [-0.5, -0.25, -2.0], [1, 3]),  # an id short
    StepLogprobs([1, 0, 2], [7, 9, 4], [-0.5, -0.25], [1, 3]),  # a value short
    StepLogprobs([1, 0, 2], [7, 9, 4], [-0.5, -0.25, -2.0], [1]),  # a rank short
    StepLogprobs([1, -1, 3], [7, 9, 4], [-0.5, -0.25, -2.0], [1, 3]),  # a negative width
    StepLogprobs([1, 0, 2], [7, 9, 4], [-0.5, -0.25, -2.0], [1, 3], ["a", "b"])])  # texts
def test_step_logprobs_whose_columns_disagree_are_refused(columns):
    with pytest.raises(MessageError, match="do not match"):
        columns.rows()


@settings(max_examples=100, deadline=None)
@given(ANY_MESSAGE, st.data())
def test_truncated_bytes_raise_message_error(msg, data):
    encoded = messages.encode(msg)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(MessageError):
        messages.decode(encoded[:cut])


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64) | st.builds(msgpack.packb, st.dictionaries(
    st.sampled_from(["t", "v", "rid", "step", "items", "req_ids"]),
    st.sampled_from(sorted(_REGISTRY)) | JSON_SCALAR | st.lists(JSON_SCALAR, max_size=2))))
def test_arbitrary_bytes_decode_or_raise_message_error_only(data):
    try:
        msg = messages.decode(data)
    except MessageError:
        return
    assert type(msg) in _REGISTRY.values()


def test_an_output_kind_travels_as_its_integer_and_an_unknown_one_is_refused():
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    plan = StepPlan(1, ["a"], [1], [0], new=[NewRequest("a", [5], 1, [0], params)])
    body = msgpack.unpackb(encode(plan), raw=False)
    assert body["new"][0]["params"]["output_kind"] == 2
    assert decode(encode(plan)).new[0].params.output_kind is RequestOutputKind.FINAL_ONLY
    for bad, says in ((7, "7 is no RequestOutputKind"), ("2", "is an integer, got str"),
                      (True, "is an integer, got bool")):
        body["new"][0]["params"]["output_kind"] = bad
        with pytest.raises(MessageError, match=says):
            decode(msgpack.packb(body))


def test_malformed_messages_raise_one_typed_error():
    good = msgpack.unpackb(messages.encode(StepPlan(1, ["r"], [1], [0])), raw=False)
    cases = {
        "unknown tag": {**good, "t": "teleport"},
        "missing field": {k: v for k, v in good.items() if k != "req_ids"},
        "wrong type": {**good, "step": "one"},
        "bool for int": {**good, "step": True},
        "odd packed length": {**good, "num_scheduled_tokens": b"\x01\x00\x00"},
        "list for packed": {**good, "num_scheduled_tokens": [1]},
        "not a map": [1, 2, 3],
    }
    for what, body in cases.items():
        try:
            messages.decode(msgpack.packb(body))
        except MessageError:
            continue
        pytest.fail(f"{what}: decoded without an error")
    replies = msgpack.unpackb(messages.encode(ReplyBatch([TextDelta("r", 0, 1, "x", [2], 3)])),
                              raw=False)
    delta = replies["items"][0]
    nested = {
        "nested record not a map": [1],
        "nested missing field": {k: v for k, v in delta.items() if k != "seq"},
        "nested bool for int": {**delta, "seq": True},
        "nested None for a list": {**delta, "logprobs": None},
        "nested int for text": {**delta, "text": 5},
    }
    for what, item in nested.items():
        with pytest.raises(MessageError):
            messages.decode(msgpack.packb({**replies, "items": [item]}))
            pytest.fail(f"{what}: decoded without an error")
    with pytest.raises(MessageError, match="not MessagePack"):
        messages.decode(b"\xc1")
    bad_params = {**msgpack.unpackb(messages.encode(
        messages.AdmitRequest("r", "x", [1], SamplingParams())), raw=False)}
    bad_params["params"] = {**bad_params["params"], "temperature": -1.0}
    with pytest.raises(MessageError):  # SamplingParams' own validation, typed the same
        messages.decode(msgpack.packb(bad_params))


def test_values_that_cannot_be_encoded_raise_message_error():
    with pytest.raises(MessageError):
        messages.encode(StepPlan(1, ["r"], [2**40], [0]))  # not an int32
    long = messages.STRUCT_MIN_ITEMS  # a list this long packs by struct, not array
    for bad in ([2**31] * long, [1.5] * long, [None] * long):
        with pytest.raises(MessageError):
            messages.encode(StepPlan(1, ["r"] * long, bad, [0] * long))
    with pytest.raises(MessageError):
        messages.encode(DetokParams())  # a record, not a registered message


def test_an_older_reader_ignores_fields_it_does_not_know():
    body = msgpack.unpackb(messages.encode(token_batch(3, [DetokItem(
        "r", 0, "x", 0, [5], [1, 2], 2, DetokParams(), 2)])), raw=False)
    body["added_later"] = 42
    body["params"][0]["also_new"] = "?"
    decoded = messages.decode(msgpack.packb(body))
    assert decoded.step == 3 and batch_items(decoded)[0].new_token_ids == [5]


def test_fields_at_their_empty_default_stay_off_the_wire():
    delta = TextDelta("r", 0, 1, "x", [2], 3)
    body = msgpack.unpackb(messages.encode(ReplyBatch([delta])), raw=False)
    assert set(body["items"][0]) == {"rid", "index", "seq", "text", "token_ids",
                                     "num_prompt_tokens"}
    assert messages.decode(messages.encode(ReplyBatch([delta]))).items == [delta]
    finished = dataclasses.replace(delta, finish_reason="stop", stop_reason=0)
    body = msgpack.unpackb(messages.encode(ReplyBatch([finished])), raw=False)
    assert body["items"][0]["finish_reason"] == "stop" and body["items"][0]["stop_reason"] == 0
    cached = dataclasses.replace(delta, num_cached_tokens=16)  # an integer off its 0
    body = msgpack.unpackb(messages.encode(ReplyBatch([cached])), raw=False)
    assert body["items"][0]["num_cached_tokens"] == 16
    assert messages.decode(messages.encode(ReplyBatch([cached]))).items == [cached]


def test_packed_fields_take_numpy_arrays_and_tuples():
    plan = StepPlan(1, ["a", "b"], np.array([3, 4], dtype=np.int64), (0, 5))
    assert messages.decode(messages.encode(plan)) == StepPlan(1, ["a", "b"], [3, 4], [0, 5])


def test_stamps_keep_microseconds_across_the_wire():
    stamps = [1_790_000_000.123456, 1_790_000_000.123457, 1_790_000_000.5]
    batch = decode(encode(token_batch(1, [], stamps)))
    assert batch.stamps == stamps


def test_stages_come_from_consecutive_stamps():
    assert request_stages([10.0, 10.5, 10.75, 12.0]) == [
        ("gateway_to_tokenizer", 0.5), ("tokenizer", 0.25), ("admit_to_plan", 1.25)]
    assert [s for s, _ in step_stages([1.0, 2.0, 3.0, 4.0, 5.0])] == [
        "plan_to_worker", "step", "result_to_detokenizer", "detokenizer"]
    assert step_stages([1.0, 2.0, 3.0]) == []  # a writer that did not stamp every hop
    assert request_stages([0.0, 1.0, 2.0, 3.0]) == []
    assert step_stages([5.0, 4.0, 6.0, 7.0, 8.0])[0] == ("plan_to_worker", 0.0)  # no negatives


@pytest.mark.parametrize("count", [1, 15, 16, 4096])
def test_packed_arrays_of_every_length_round_trip(count):
    """Short lists pack by array, long ones by struct: the same bytes either way."""
    ints = [(-1) ** i * (i * 7919 % 2**31) for i in range(count)]
    stamps = [1_790_000_000.123456 + i for i in range(count)]
    values = [-i / 3 for i in range(count)]
    result = StepResult(3, ["r"] * count, ints, StepLogprobs([1] * count, ints, values, ints),
                        stamps=stamps)
    assert decode(encode(result)) == dataclasses.replace(
        result, logprobs=StepLogprobs([1] * count, ints, [float(np.float32(v)) for v in values],
                                      ints))
    assert np.frombuffer(messages._codec(messages.Tokens)[0](ints), "<i4").tolist() == ints

"""SamplingParams: validation names the field and the value, normalisation, and every valid
combination survives the wire inside an AdmitRequest."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import AdmitRequest, decode, encode
from common.sampling_params import SamplingError, SamplingParams

INVALID: list[tuple[str, Any]] = [
    ("n", 0), ("n", -3), ("n", 1.5), ("n", 129), ("n", 2**31 - 1),
    # past 64 bits, which the bus's MessagePack cannot carry
    ("top_k", 2**63), ("max_tokens", 2**64), ("min_tokens", 10**30), ("logprobs", 2**63),
    ("prompt_logprobs", 2**70), ("seed", -2**63 - 1),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5), ("presence_penalty", float("nan")),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.001),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("nan")),
    ("temperature", -0.01), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")),
    ("seed", 1.5), ("seed", "7"),
    ("max_tokens", 0), ("max_tokens", -4), ("max_tokens", 8.0),
    ("min_tokens", -1), ("min_tokens", 2.0),
    ("logprobs", -1), ("logprobs", 1.5),
    ("prompt_logprobs", -2), ("prompt_logprobs", 0.5),
    ("stop", ""), ("stop", ("ok", "")), ("stop", ("ok", 3)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", (5, 2.0)), ("stop_token_ids", ("x",)),
    ("logit_bias", [1, 2]), ("logit_bias", {"x": 1.0}), ("logit_bias", {"-3": 1.0}),
    ("logit_bias", {-3: 1.0}), ("logit_bias", {2**31: 1.0}), ("logit_bias", {5: "1"}),
    ("logit_bias", {5: float("inf")}), ("logit_bias", {5: True}),
    ("allowed_token_ids", ()), ("allowed_token_ids", (-1,)), ("allowed_token_ids", ("7",)),
    ("allowed_token_ids", "7"), ("allowed_token_ids", 7),
]


@pytest.mark.parametrize("name, value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_names_field_and_value(name: str, value: Any) -> None:
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**{name: value})
    assert caught.value.param == name
    assert name in str(caught.value)
    shown = repr(value) if not isinstance(value, tuple) else repr(tuple(value))
    assert shown in str(caught.value)


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(SamplingError) as caught:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert caught.value.param == "min_tokens" and "5" in str(caught.value)
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(max_tokens=None, min_tokens=500).max_tokens is None


def test_replace_validates_again() -> None:
    params = SamplingParams(temperature=0.5, top_k=10)
    assert params.replace(top_k=3) == SamplingParams(temperature=0.5, top_k=3)
    with pytest.raises(SamplingError) as caught:
        params.replace(temperature=-1.0)
    assert caught.value.param == "temperature"


def test_params_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_check_logprobs_against_the_server_limit(name: str) -> None:
    SamplingParams(**{name: 20}).check_logprobs(20)
    SamplingParams().check_logprobs(0)
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**{name: 21}).check_logprobs(20)
    assert caught.value.param == name and "21" in str(caught.value)


@pytest.mark.parametrize("given_value, stored", [
    ("END", ("END",)), (["a", "bc"], ("a", "bc")), (("x",), ("x",)), (None, ()), ([], ())])
def test_stop_normalises_to_a_tuple(given_value: Any, stored: tuple[str, ...]) -> None:
    assert SamplingParams(stop=given_value).stop == stored


@pytest.mark.parametrize("name", ["stop_token_ids", "eos_token_ids"])
@pytest.mark.parametrize("given_value, stored", [(7, (7,)), ([3, 1, 3], (3, 1, 3)),
                                                 (None, ()), ((), ())])
def test_token_id_lists_normalise_to_tuples(name: str, given_value: Any,
                                            stored: tuple[int, ...]) -> None:
    assert getattr(SamplingParams(**{name: given_value}), name) == stored


def test_logit_bias_takes_json_keys_and_clamps_as_vllm_does() -> None:
    params = SamplingParams(logit_bias={"50256": -200, 7: 2.5, "8": 1000.0})
    assert params.logit_bias == {50256: -100.0, 7: 2.5, 8: 100.0}
    assert SamplingParams(allowed_token_ids=[4, 4, 2]).allowed_token_ids == (4, 4, 2)
    assert hash(params) == hash(SamplingParams(logit_bias={1: 1.0}))  # the dict is unhashed


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False),
                                                 (0.7, False), (2.0, False)])
def test_greedy_below_a_tiny_temperature(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


# --- every valid combination crosses the wire unchanged -------------------------------------

def unit_floats(low: float, high: float, exclude_min: bool = False) -> st.SearchStrategy[float]:
    return st.floats(low, high, exclude_min=exclude_min, allow_nan=False)


token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=4)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.none() | st.integers(1, 1 << 20))
    min_tokens = draw(st.integers(0, max_tokens if max_tokens is not None else 1 << 20))
    optional_k = st.none() | st.integers(0, 20)
    return SamplingParams(
        n=draw(st.integers(1, 8)),
        presence_penalty=draw(unit_floats(-2.0, 2.0)),
        frequency_penalty=draw(unit_floats(-2.0, 2.0)),
        repetition_penalty=draw(unit_floats(0.0, 10.0, exclude_min=True)),
        temperature=draw(unit_floats(0.0, 5.0)),
        top_p=draw(unit_floats(0.0, 1.0, exclude_min=True)),
        top_k=draw(st.integers(-1, 1000)),
        min_p=draw(unit_floats(0.0, 1.0)),
        seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        stop=draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)),
        stop_token_ids=draw(token_ids),
        ignore_eos=draw(st.booleans()),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        logprobs=draw(optional_k),
        prompt_logprobs=draw(optional_k),
        skip_special_tokens=draw(st.booleans()),
        spaces_between_special_tokens=draw(st.booleans()),
        include_stop_str_in_output=draw(st.booleans()),
        eos_token_ids=draw(token_ids),
        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, 2**31 - 1),
                                                    unit_floats(-100.0, 100.0), max_size=3)),
        allowed_token_ids=draw(st.none() | token_ids.filter(bool)),
    )


@settings(max_examples=300, deadline=None)
@given(params=sampling_params(), prompt=st.lists(st.integers(0, 2**31 - 1), max_size=16))
def test_valid_params_survive_an_admit_request(params: SamplingParams, prompt: list[int]) -> None:
    message = AdmitRequest("r-1", "gw-0", prompt, params, arrival_time=1.5, priority=-2)
    decoded = decode(encode(message))
    assert decoded == message
    assert isinstance(decoded.params, SamplingParams)
    assert isinstance(decoded.params.stop, tuple)
    assert decoded.params.greedy == params.greedy


def test_an_integer_for_a_float_parameter_becomes_a_float_the_bus_can_carry():
    assert SamplingParams(temperature=2**64).temperature == float(2**64)
    assert isinstance(SamplingParams(top_p=1).top_p, float)
    with pytest.raises(SamplingError) as caught:
        SamplingParams(temperature=10**400)
    assert caught.value.param == "temperature"

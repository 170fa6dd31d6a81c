"""Structured outputs below the model: the `structured_outputs` parameter (shapes, wire,
errors), its xgrammar translation, the engine flag, the worker's grammar bookkeeping
(services/worker/grammar.py) and the scheduler's end-of-grammar rule."""

from __future__ import annotations

import argparse
import logging

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from common.config import ConfigError, EngineConfig, add_engine_args, engine_config_from_args
from common.errors import ApiError
from common.messages import AdmitRequest, GenerateRequest, decode, encode
from common.sampling_defaults import SamplingDefaults
from common.sampling_params import SamplingError, SamplingParams, json_kinds
from common.structured_outputs import choice_ebnf, spec_key, to_grammar
from services.tokenizer.core import InputProcessor
from services.worker import grammar as grammar_module
from services.worker.grammar import Grammars, accept, hold_back
from tests.test_scheduler import EOS, admit, drive, make
from tests.tiny_models import TINY_VOCAB, tokenizer_dir

SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_dir())


@pytest.fixture
def grammars(tokenizer) -> Grammars:
    return Grammars(lambda: tokenizer, len(tokenizer), torch.device("cpu"))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(mask_row: torch.Tensor) -> set[int]:
    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


# --- the parameter ------------------------------------------------------------------------

@pytest.mark.parametrize("spec, shown", [
    ({"json": SCHEMA}, {"json": SCHEMA}),
    ({"json": '{"type": "object"}'}, {"json": {"type": "object"}}),  # a string is parsed
    ({"json_object": True, "regex": None}, {"json_object": True}),  # vLLM's unset keys
    ({"regex": r"\d+"}, {"regex": r"\d+"}),
    ({"choice": ("a", "b")}, {"choice": ["a", "b"]}),
    ({"grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'})])
def test_valid_specs_normalise_and_cross_the_wire(spec, shown):
    params = SamplingParams(structured_outputs=spec)
    assert params.structured_outputs == shown
    assert hash(params) == hash(SamplingParams(structured_outputs=spec))
    admitted = decode(encode(AdmitRequest("r", "gw", [1, 2], params)))
    assert admitted.params == params


@pytest.mark.parametrize("spec, words", [
    ("json", "an object with exactly one of the keys json, json_object, regex"),
    ({}, "exactly one of the keys"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of the keys"),
    ({"schema": SCHEMA}, "exactly one of the keys"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": [1]}, "structured_outputs.json must be a JSON schema"),
    ({"json_object": False}, "structured_outputs.json_object must be true"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string"),
    ({"json": {"maximum": 2**70}}, "integers of 64 bits"),
    ({"json": {"enum": [{1, 2}]}}, "JSON values only")])
def test_bad_shapes_name_the_parameter(spec, words):
    with pytest.raises(SamplingError) as caught:
        SamplingParams(structured_outputs=spec)
    assert caught.value.param == "structured_outputs" and words in str(caught.value)


def test_the_gateway_and_tokenizer_see_a_json_object():
    assert json_kinds("structured_outputs") == (dict,)


@pytest.mark.parametrize("spec, words", [
    ({"json": {"type": "objec"}}, 'structured_outputs.json is invalid: Unsupported type "objec"'),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum greater than maximum"),
    ({"regex": "[a-z"}, "structured_outputs.regex is invalid: Regex parsing error"),
    ({"grammar": "root ::= foo"}, 'structured_outputs.grammar is invalid: EBNF parser error'
                                  ' at line 1, column 10: Rule "foo" is not defined')])
def test_what_xgrammar_refuses_is_a_clear_error(spec, words):
    with pytest.raises(SamplingError) as caught:
        to_grammar(SamplingParams(structured_outputs=spec).structured_outputs)
    assert caught.value.param == "structured_outputs" and words in str(caught.value)
    assert ".cc:" not in str(caught.value)  # xgrammar's source position is cut


def test_choices_are_literal_strings():
    assert choice_ebnf(['a"b', "c\\d", "é\n"]) == r'root ::= "a\"b" | "c\\d" | "é\n"'
    to_grammar({"choice": ['a"b', "c\\d", "é\n", ""]})


def test_spec_key_ignores_key_order():
    assert spec_key({"json": {"a": 1, "b": 2}}) == spec_key({"json": {"b": 2, "a": 1}})


def test_the_tokenizer_stage_refuses_a_bad_grammar(tokenizer):
    processor = InputProcessor(tokenizer, 64, SamplingDefaults({}), 5, TINY_VOCAB, (EOS,))
    good = processor.process(GenerateRequest("g", "gw", {"structured_outputs": {
        "regex": "[ab]+"}}, prompt_token_ids=[5, 6]))
    assert good.params.structured_outputs == {"regex": "[ab]+"}
    for params, words in [({"structured_outputs": {"regex": "(("}}, "Regex parsing error"),
                          ({"structured_outputs": "x"}, "must be an object")]:
        with pytest.raises(ApiError) as caught:
            processor.process(GenerateRequest("b", "gw", params, prompt_token_ids=[5, 6]))
        assert caught.value.status == 400 and caught.value.param == "structured_outputs"
        assert words in caught.value.message


def test_the_backend_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flag in ("--guided-decoding-backend", "--structured-outputs-config.backend"):
        args = parser.parse_args(["--model", "m", flag, "xgrammar"])
        assert engine_config_from_args(args).guided_decoding_backend == "xgrammar"
    assert EngineConfig().guided_decoding_backend == "auto"
    with pytest.raises(ConfigError, match=r"--guided-decoding-backend must be one of "
                                          r"\['auto', 'xgrammar'\], got 'outlines'"):
        EngineConfig(guided_decoding_backend="outlines")


# --- the worker's bookkeeping ---------------------------------------------------------------

def test_compiled_grammars_are_cached_by_spec(grammars, monkeypatch):
    one = grammars._compiled({"json": {"type": "object", "required": ["a", "b"]}})
    assert grammars._compiled({"json": {"required": ["a", "b"], "type": "object"}}) is one
    monkeypatch.setattr(grammar_module, "CACHE_SIZE", 2)
    grammars._compiled({"regex": "a"})
    grammars._compiled({"regex": "b"})  # the least recent, the schema, leaves
    assert grammars._compiled({"regex": "a"}) is not None
    assert grammars._compiled({"json": {"type": "object", "required": ["a", "b"]}}) is not one


def test_a_matcher_replays_the_outputs_so_far(grammars, tokenizer):
    params = SamplingParams(structured_outputs={"json": SCHEMA}, eos_token_ids=(EOS,))
    prefix = ids(tokenizer, '{"a": 1')
    stepwise = grammars.matcher("r", params, [])
    for token in prefix:
        accept(stepwise, token, "r")
    replayed = grammars.matcher("r", params, prefix)  # as after a preemption
    mask = grammars.mask([(0, stepwise, ()), (1, replayed, ())])
    assert torch.equal(mask.bitmask[0], mask.bitmask[1])
    assert mask.rows.tolist() == [0, 1]
    assert set(ids(tokenizer, "}")) <= allowed(mask.bitmask[0])
    assert EOS not in allowed(mask.bitmask[0])  # the object is still open


def test_eos_only_where_the_grammar_is_complete(grammars, tokenizer):
    params = SamplingParams(structured_outputs={"choice": ["ab", "abab"]}, eos_token_ids=(EOS,))
    matcher = grammars.matcher("r", params, ids(tokenizer, "ab"))
    row = grammars.mask([(3, matcher, ())]).bitmask[0]
    assert EOS in allowed(row) and set(ids(tokenizer, "a")) <= allowed(row)
    accept(matcher, EOS, "r")
    assert matcher.is_terminated()
    accept(matcher, 7, "r")  # a token planned past the end: taken as nothing


def test_min_tokens_holds_eos_back_only_while_the_grammar_goes_on(grammars, tokenizer):
    params = SamplingParams(structured_outputs={"choice": ["ab", "abab"]}, eos_token_ids=(EOS,))
    going_on = grammars.matcher("r", params, ids(tokenizer, "ab"))
    ended = grammars.matcher("s", params, ids(tokenizer, "abab"))
    mask = grammars.mask([(0, going_on, (EOS,)), (1, ended, (EOS,))])
    assert EOS not in allowed(mask.bitmask[0]) and allowed(mask.bitmask[0])
    assert allowed(mask.bitmask[1]) == {EOS}  # the grammar can only end: it ends


def test_hold_back_clears_bits_unless_nothing_is_left():
    words = np.array([0b1011, 1 << 31], dtype=np.uint32)
    hold_back(words, [0, 63, 5000])
    assert words.tolist() == [0b1010, 0]
    only = np.array([0b1, 0], dtype=np.uint32)
    hold_back(only, [0])
    assert only.tolist() == [1, 0]


def test_a_grammar_that_fails_to_compile_runs_unconstrained(grammars, monkeypatch, caplog):
    def refuse(spec):
        raise SamplingError("structured_outputs.regex is invalid: no", "structured_outputs")
    monkeypatch.setattr(grammar_module, "to_grammar", refuse)
    params = SamplingParams(structured_outputs={"regex": "a"}, eos_token_ids=(EOS,))
    with caplog.at_level(logging.ERROR, "headrace.worker.grammar"):
        assert grammars.matcher("r", params, []) is None
    assert "request r runs unconstrained" in caplog.text


# --- the scheduler -----------------------------------------------------------------------

@pytest.mark.parametrize("lag", [0, 1])
def test_the_end_of_a_grammar_ends_the_request(lag):
    sched, worker = make()
    worker.overrides = {"ignore#0": EOS, "minimum#0": EOS, "stopid#0": 17, "plain#0": EOS}
    structured = {"structured_outputs": {"regex": "a*"}}
    admit(sched, "ignore", [5, 6], max_tokens=4, ignore_eos=True, **structured)
    admit(sched, "minimum", [5, 6], max_tokens=4, min_tokens=3, **structured)
    admit(sched, "stopid", [5, 6], max_tokens=4, min_tokens=3, stop_token_ids=[17],
          **structured)
    admit(sched, "plain", [5, 6], max_tokens=4, ignore_eos=True)
    run = drive(sched, worker, lag=lag)
    for rid in ("ignore", "minimum"):  # EOS ends it, ignore_eos and min_tokens or not
        assert run.outputs[(rid, 0)] == [EOS] and run.finish[(rid, 0)] == "stop"
    # a stop token id a grammar forced before min_tokens is one more token of its text
    assert run.outputs[("stopid", 0)] == [17] * 3 and run.finish[("stopid", 0)] == "stop"
    assert run.outputs[("plain", 0)] == [EOS] * 4 and run.finish[("plain", 0)] == "length"

"""Sampling defaults from a generation config ('auto', 'vllm', a directory) and EOS ids."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from common.sampling_params import SamplingParams
from common.sampling_defaults import SamplingDefaults, eos_token_ids, sampling_defaults

MODEL_CONFIG = {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True,
                "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None,
                "max_new_tokens": 100}


def test_auto_takes_the_model_values_that_are_set():
    defaults = sampling_defaults("auto", MODEL_CONFIG)
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    params = defaults.default_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0  # SamplingParams'
    assert params.max_tokens == 100


def test_client_values_win_over_model_defaults():
    params = sampling_defaults("auto", MODEL_CONFIG).params_for(
        {"temperature": 0.1, "repetition_penalty": 1.2, "max_tokens": 50})
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.1, 0.95, 1.2)
    assert params.max_tokens == 50


def test_max_new_tokens_caps_every_request():
    defaults = sampling_defaults("auto", MODEL_CONFIG)
    assert defaults.params_for({"max_tokens": 500}).max_tokens == 100
    assert defaults.params_for({}).max_tokens == 100
    assert defaults.cap(None) == 100 and defaults.cap(30) == 30


def test_without_max_new_tokens_an_unset_max_tokens_stays_open():
    defaults = sampling_defaults("auto", {"temperature": 0.7})
    assert defaults.params_for({}).max_tokens is None
    assert defaults.default_params().max_tokens == SamplingParams().max_tokens


def test_vllm_ignores_the_model_config():
    defaults = sampling_defaults("vllm", MODEL_CONFIG)
    assert defaults == SamplingDefaults()
    assert defaults.default_params() == SamplingParams()


def test_auto_without_a_model_config_has_no_defaults():
    assert sampling_defaults("auto", None).default_params() == SamplingParams()


def test_a_directory_is_read(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "repetition_penalty": 1.1, "max_new_tokens": 8}))
    defaults = sampling_defaults(str(tmp_path), MODEL_CONFIG)
    params = defaults.default_params()
    assert (params.temperature, params.repetition_penalty, params.top_p) == (0.3, 1.1, 1.0)
    assert defaults.max_new_tokens == 8


def test_a_directory_without_the_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="generation_config.json.*does not exist"):
        sampling_defaults(str(tmp_path / "nowhere"), None)


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read"),
    ("[1, 2]", "JSON object"),
    ('{"temperature": -1}', "temperature must be a finite non-negative number"),
    ('{"temperature": "hot"}', "invalid sampling default"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be a positive integer"),
])
def test_a_bad_config_fails_at_start_up(tmp_path, content, message):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        sampling_defaults(str(tmp_path), None)


@pytest.mark.parametrize("config, expected", [
    (None, (2,)),
    ({}, (2,)),
    ({"eos_token_id": 2}, (2,)),
    ({"eos_token_id": 9}, (2, 9)),
    ({"eos_token_id": [9, 2, 11]}, (2, 9, 11)),
])
def test_eos_ids_are_the_union_of_tokenizer_and_config(config, expected):
    assert eos_token_ids(SimpleNamespace(eos_token_id=2), config) == expected


def test_eos_ids_without_a_tokenizer_eos():
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), {"eos_token_id": [5]}) == (5,)


def test_overrides_go_over_the_chosen_config():
    overrides = {"temperature": 0.2, "max_new_tokens": 7}
    defaults = sampling_defaults("auto", MODEL_CONFIG, overrides)
    assert defaults.values == {"temperature": 0.2, "top_p": 0.95, "top_k": 20}
    assert defaults.max_new_tokens == 7
    assert sampling_defaults("vllm", MODEL_CONFIG, overrides).values == {"temperature": 0.2}
    with pytest.raises(ValueError, match="--override-generation-config.*temperature"):
        sampling_defaults("vllm", None, {"temperature": -1})

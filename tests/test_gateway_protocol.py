"""The gateway's pure parts: OpenAI body parsing and validation, choices assembled from
text deltas (order, duplicates, the finish), the calls' responses and chunks, logprobs
objects, latencies and the admission decision."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common import keys
from common.bus import GroupInfo, StreamInfo
from common.errors import ApiError
from common.messages import (ErrorReply, GenerateRequest, SchedulerStats, TextDelta,
                             TokenLogprobs, encode)
from services.gateway import responses
from services.gateway.core import (STALE_S, Backend, Call, Echo, Shard, admission_error,
                                   dead_reply_streams, queue_depth, redis_out_of_sight,
                                   request_ids, scheduler_gone, scheduler_restarted)
from services.gateway.protocol import _UNSUPPORTED as UNSUPPORTED
from services.gateway.protocol import Limits, parse_detokenize, parse_job, parse_tokenize
from services.gateway.request_bodies import (ChatCompletionRequest, CompletionRequest,
                                             ResponsesRequest)
from services.gateway.responses_api import _UNSUPPORTED as RESPONSES_UNSUPPORTED
from services.gateway.responses_api import parse_responses, responses_call
from services.gateway.scoring import parse_rerank, parse_score
from services.gateway.response_bodies import to_dict
from services.gateway.responses import Choice

USER = [{"role": "user", "content": "Hi"}]


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": USER, **fields}


def refused(body, is_chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_job(body, is_chat)
    assert info.value.status == 400
    return info.value


# --- parsing ----------------------------------------------------------------------------

def test_params_hold_only_what_the_client_set():
    job = parse_job(chat(), chat=True)
    assert job.params == {} and job.n == 1 and not job.stream and not job.echo
    job = parse_job(completion(temperature=0, top_p=0.5, top_k=5, min_p=0.1, seed=7, n=2,
                               presence_penalty=0.5, frequency_penalty=-0.5,
                               repetition_penalty=1.1, max_tokens=9, stop="x",
                               ignore_eos=True, min_tokens=1, stop_token_ids=[3],
                               user="u", priority=-2), chat=False)
    assert job.params == {"temperature": 0, "top_p": 0.5, "top_k": 5, "min_p": 0.1,
                          "seed": 7, "n": 2, "presence_penalty": 0.5,
                          "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                          "max_tokens": 9, "stop": ["x"], "ignore_eos": True,
                          "min_tokens": 1, "stop_token_ids": [3]}
    assert job.n == 2 and job.priority == -2


def test_nulls_count_as_not_set():
    job = parse_job(completion(temperature=None, stop=None, logit_bias=None, tools=None,
                               stream_options=None, whatever=None), chat=False)
    assert job.params == {"max_tokens": 16} and not job.include_usage


@pytest.mark.parametrize("prompt, expected", [
    ("Hi", ["Hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_forms(prompt, expected):
    assert parse_job(completion(prompt=prompt), chat=False).prompts == expected


@pytest.mark.parametrize("prompt", [None, [], 5, ["a", 1], [[1], []], [True, 2], [-1],
                                    [2**31], [[1], "a"], {"text": "a"}])
def test_bad_prompts(prompt):
    assert refused(completion(prompt=prompt)).param == "prompt"


@pytest.mark.parametrize("name, value", [
    ("temperature", "hot"), ("temperature", True), ("n", 1.5), ("n", "2"), ("seed", 1.0),
    ("top_k", 2.5), ("top_p", [1]), ("max_tokens", "9"), ("stop", 3), ("stop", ["a", 1]),
    ("ignore_eos", 1), ("stream", "yes"), ("echo", 1), ("priority", 0.5), ("logprobs", True),
    ("model", 3), ("stream_options", []), ("stop_token_ids", 3),
])
def test_wrong_json_types_name_the_field(name, value):
    error = refused(completion(**{name: value}))
    assert error.param == name and name in error.message


@pytest.mark.parametrize("name, value", [
    ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("n", 0), ("max_tokens", 0), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("seed", 2**64), ("logprobs", -1), ("min_tokens", -1),
    ("stop", [""]), ("stop_token_ids", [-1]), ("prompt_logprobs", -2),
])
def test_ranges_are_sampling_params_ranges(name, value):
    error = refused(completion(**{name: value}))
    assert error.param == name and name in error.message


def test_temperature_nan_and_inf_are_refused():
    for value in (math.inf, math.nan):
        assert refused(completion(temperature=value)).param == "temperature"


@pytest.mark.parametrize("name", ["suffix", "functions", "logits_processors", "cache_salt",
                                  "prompt_embeds", "vllm_xargs"])
def test_features_this_server_lacks_are_refused_by_name(name):
    error = refused(chat(**{name: {"x": 1}}), is_chat=True)
    assert error.param == name and "not supported" in error.message


# Every field of vLLM's request bodies (vllm/entrypoints/openai/protocol.py of 0.10 and 0.11,
# and the chat_completion/ and completion/ protocol.py that followed): each is either one
# this server reads or one it refuses when it asks for something; none is dropped unread.
VLLM_SHARED_FIELDS = """
model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream
stream_options temperature top_p user best_of use_beam_search top_k min_p repetition_penalty
watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo add_special_tokens
response_format structured_outputs guided_json guided_regex guided_choice guided_grammar
guided_decoding_backend guided_whitespace_pattern priority request_id session_id
logits_processors return_tokens_as_token_ids return_token_ids routed_experts_prompt_start
return_token_offsets return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params
vllm_xargs repetition_detection thinking_token_budget stream_interval""".split()
VLLM_CHAT_FIELDS = VLLM_SHARED_FIELDS + """
messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls add_generation_prompt continue_final_message documents
chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs structural_tag
return_prompt_text""".split()
VLLM_COMPLETION_FIELDS = VLLM_SHARED_FIELDS + ["prompt", "suffix", "prompt_embeds"]
# Each refused field with a value that asks for something, and the values that do not.
ASKING = {"continue_final_message": True, "return_token_ids": True, "return_prompt_text": True,
          "return_token_offsets": True, "return_mm_kwargs": False, "watermarking": True,
          "routed_experts_prompt_start": 3, "thinking_token_budget": 100,
          "truncation_side": "right", "guided_decoding_backend": "outlines",
          "guided_whitespace_pattern": " *", "logprob_token_ids": [5], "stream_interval": 4,
          "repetition_detection": {"max_pattern_size": 4}, "structural_tag": "{}",
          "documents": [{"text": "x"}], "chat_template": "{{ x }}", "prompt_embeds": "AAAA",
          "reasoning_effort": "low", "suffix": "end", "echo": True}
NOTHING = {"continue_final_message": False, "return_token_ids": False,
           "return_mm_kwargs": True, "watermarking": False, "routed_experts_prompt_start": 0,
           "thinking_token_budget": -1, "truncation_side": "left",
           "guided_decoding_backend": "xgrammar", "echo": False}


@pytest.mark.parametrize("is_chat", [True, False])
def test_every_vllm_request_field_is_read_or_refused(is_chat):
    model = ChatCompletionRequest if is_chat else CompletionRequest
    unread = [name for name in (VLLM_CHAT_FIELDS if is_chat else VLLM_COMPLETION_FIELDS)
              if name not in model.model_fields and name not in UNSUPPORTED]
    assert unread == []
    for name in (set(VLLM_CHAT_FIELDS) | set(VLLM_COMPLETION_FIELDS)) & set(UNSUPPORTED):
        body = (chat if is_chat else completion)(**{name: ASKING.get(name, {"x": 1})})
        error = refused(body, is_chat)
        assert error.param == name and "not supported" in error.message, name
    for name, value in NOTHING.items():  # as a serialized vLLM request sends them
        job = parse_job((chat if is_chat else completion)(**{name: value}), is_chat)
        assert job.ignored == [] and not job.echo
    error = refused(chat(echo=True), is_chat=True)  # vLLM's chat echo repeats a message
    assert error.param == "echo" and "chat" in error.message
    assert parse_job(completion(echo=True), chat=False).echo


def test_every_vllm_responses_field_is_read_or_refused():
    fields = """background include input instructions max_output_tokens max_tool_calls metadata
    model parallel_tool_calls previous_response_id prompt reasoning service_tier store stream
    temperature text tool_choice tools top_logprobs top_p truncation user request_id
    mm_processor_kwargs priority cache_salt conversation""".split()
    assert [name for name in fields if name not in ResponsesRequest.model_fields
            and name not in RESPONSES_UNSUPPORTED] == []
    asking = {"background": True, "include": ["message.output_text.logprobs"],
              "max_tool_calls": 2, "top_logprobs": 2, "truncation": "auto",
              "service_tier": "flex", "request_id": "resp_x", "cache_salt": "s"}
    for name in RESPONSES_UNSUPPORTED:
        with pytest.raises(ApiError) as info:
            parse_responses({"input": "Hi", name: asking.get(name, {"x": 1})})
        assert info.value.param == name and "not supported" in info.value.message
    quiet = {"input": "Hi", "background": False, "include": [], "top_logprobs": 0,
             "truncation": "disabled", "service_tier": "auto", "priority": -3}
    call = responses_call(parse_responses(quiet), [])
    assert call.job.priority == -3 and call.job.ignored == []


def test_score_and_rerank_honour_priority_and_refuse_what_they_cannot_do():
    score = {"text_1": "a", "text_2": ["b", "c"]}
    rerank = {"query": "a", "documents": ["b", "c"]}
    assert parse_score({**score, "priority": 4}).job.priority == 4
    assert parse_rerank({**rerank, "priority": -1}).pairs.job.priority == -1
    for parse, body in ((parse_score, score), (parse_rerank, rerank)):
        for name in ("mm_processor_kwargs", "activation", "use_activation", "softmax"):
            with pytest.raises(ApiError) as info:
                parse({**body, name: True if name != "mm_processor_kwargs" else {"x": 1}})
            assert info.value.param == name and "not supported" in info.value.message
        with pytest.raises(ApiError) as info:
            parse({**body, "priority": 2**63})
        assert info.value.param == "priority"


def test_logit_bias_and_allowed_token_ids_reach_the_params_as_json():
    job = parse_job(chat(logit_bias={"50": -200, "7": 3}, allowed_token_ids=[7, 9]),
                    chat=True)
    assert job.params["logit_bias"] == {"50": -100.0, "7": 3.0}  # clamped, keys as sent
    assert job.params["allowed_token_ids"] == [7, 9]
    for body, param in ((chat(logit_bias={"x": 1}), "logit_bias"),
                        (chat(logit_bias={"5": "high"}), "logit_bias"),
                        (chat(logit_bias=[5]), "logit_bias"),
                        (completion(allowed_token_ids=[]), "allowed_token_ids"),
                        (completion(allowed_token_ids=["5"]), "allowed_token_ids")):
        assert refused(body, is_chat="messages" in body).param == param


def test_unknown_fields_are_ignored_and_named():
    job = parse_job(completion(max_new_tokens=5, messages=USER, zeta=None), chat=False)
    assert job.ignored == ["max_new_tokens", "messages"] and "max_new_tokens" not in job.params
    job = parse_job(chat(prompt="x", echo=False), chat=True)
    assert job.ignored == ["prompt"] and not job.echo
    assert parse_job(chat(), chat=True).ignored == []
    assert parse_tokenize({"prompt": "Hi", "truncate": 3}).ignored == ["truncate"]


def test_response_format_and_guided_fields_become_structured_outputs():
    job = parse_job(chat(response_format={"type": "text"}), chat=True)
    assert "response_format" not in job.params and "structured_outputs" not in job.params
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body, expected in [
            ({"response_format": {"type": "json_object"}}, {"json_object": True}),
            ({"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema}}},
             {"json": schema}),
            ({"guided_json": schema}, {"json": schema}),
            ({"guided_regex": "[ab]+"}, {"regex": "[ab]+"}),
            ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
            ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
            ({"structured_outputs": {"regex": "a"}}, {"regex": "a"})]:
        assert parse_job(chat(**body), chat=True).params["structured_outputs"] == expected
    error = refused(chat(response_format={"type": "json_schema"}), is_chat=True)
    assert error.param == "response_format" and "json_schema.schema" in error.message
    error = refused(chat(response_format={"type": "xml"}), is_chat=True)
    assert error.param == "response_format"
    error = refused(completion(guided_regex="a", guided_choice=["a"]))
    assert "one way" in error.message


def test_completions_default_to_16_tokens_as_openai_and_vllm():
    assert parse_job(completion(), chat=False).params["max_tokens"] == 16
    assert parse_job(completion(max_tokens=3), chat=False).params["max_tokens"] == 3
    assert "max_tokens" not in parse_job(chat(), chat=True).params  # the context's limit


def test_prompt_logprobs_cannot_stream():
    error = refused(completion(stream=True, prompt_logprobs=1))
    assert error.param == "prompt_logprobs" and "stream" in error.message
    job = parse_job(completion(stream=True, echo=True, logprobs=1), chat=False)
    assert job.params["prompt_logprobs"] == 1  # echo's own prompt logprobs still stream


def test_the_body_must_be_an_object():
    for body in ([], "x", 3, None):
        assert refused(body).param is None


def test_chat_messages():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None}]
    job = parse_job(chat(messages=parts), chat=True)
    assert job.messages == parts and job.prompts == [] and job.add_generation_prompt
    for messages in (None, [], [{"content": "x"}], ["x"], [{"role": "user", "content": 3}],
                     [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
                     [{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": "u", "detail": "x"}}]}],
                     [{"role": "user", "content": [{"type": "video_url",
                                                    "video_url": {"uri": "u"}}]}]):
        assert refused(chat(messages=messages), is_chat=True).param == "messages"
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "u"}}]}]
    assert parse_job(chat(messages=video), chat=True).messages == video
    job = parse_job(chat(add_generation_prompt=False), chat=True)
    assert not job.add_generation_prompt


def test_chat_max_completion_tokens_wins_over_max_tokens():
    job = parse_job(chat(max_tokens=5, max_completion_tokens=7), chat=True)
    assert job.params["max_tokens"] == 7
    assert parse_job(chat(max_tokens=5), chat=True).params["max_tokens"] == 5
    assert refused(chat(max_completion_tokens=0), is_chat=True).param == "max_tokens"


def test_logprobs():
    assert parse_job(completion(logprobs=3, max_tokens=5), chat=False).params == {
        "logprobs": 3, "max_tokens": 5}
    job = parse_job(completion(logprobs=2, echo=True, max_tokens=5), chat=False)
    assert job.params == {"logprobs": 2, "prompt_logprobs": 2, "max_tokens": 5}
    assert job.echo and job.logprobs
    job = parse_job(completion(logprobs=2, echo=True, prompt_logprobs=4), chat=False)
    assert job.params["prompt_logprobs"] == 4
    assert parse_job(chat(logprobs=True), chat=True).params == {"logprobs": 0}
    assert parse_job(chat(logprobs=True, top_logprobs=3), chat=True).params == {"logprobs": 3}
    assert parse_job(chat(logprobs=False), chat=True).params == {}
    assert refused(chat(top_logprobs=2), is_chat=True).param == "top_logprobs"
    assert refused(chat(logprobs=True, top_logprobs=-1), is_chat=True).param == "top_logprobs"
    assert refused(chat(logprobs=2), is_chat=True).param == "logprobs"


def test_stream_options():
    job = parse_job(completion(stream=True, stream_options={"include_usage": True}), False)
    assert job.stream and job.include_usage
    assert not parse_job(completion(stream=True, stream_options={}), False).include_usage
    assert refused(completion(stream_options={"include_usage": True})).param == "stream_options"
    assert refused(completion(stream=True, stream_options={"x": 1})).param == "stream_options"
    error = refused(completion(stream=True, stream_options={"include_usage": 1}))
    assert error.param == "stream_options" and "stream_options.include_usage" in error.message
    job = parse_job(completion(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}), False)
    assert job.include_usage and job.continuous_usage


def test_model_is_optional():
    assert parse_job({"prompt": "x"}, chat=False).model is None


def test_tokenize_and_detokenize_bodies():
    job = parse_tokenize({"model": "m", "prompt": "Hi"})
    assert (job.prompt, job.messages, job.add_special_tokens) == ("Hi", None, True)
    job = parse_tokenize({"messages": USER, "add_generation_prompt": False})
    assert job.messages == USER and not job.add_special_tokens and not job.add_generation_prompt
    for body in ({}, {"prompt": "a", "messages": USER}, {"prompt": 3}, {"messages": "a"}, []):
        with pytest.raises(ApiError) as info:
            parse_tokenize(body)
        assert info.value.status == 400
    assert parse_detokenize({"model": "m", "tokens": [1, 2]}) == ("m", [1, 2])
    assert parse_detokenize({"tokens": []}) == (None, [])
    for body in ({}, {"tokens": [1.0]}, {"tokens": [-1]}, {"tokens": "1"}, {"tokens": [True]}):
        with pytest.raises(ApiError) as info:
            parse_detokenize(body)
        assert info.value.param == "tokens"


def test_api_error_shape_and_retry_after():
    error = ApiError(400, "bad", "temperature")
    assert error.body() == {"error": {"message": "bad", "type": "BadRequestError",
                                      "param": "temperature", "code": 400}}
    assert error.headers() == {}
    busy = ApiError(503, "full")
    assert busy.body()["error"]["type"] == "ServiceUnavailableError"
    assert busy.headers() == {"Retry-After": "1"}
    assert ApiError(401, "x").kind == "AuthenticationError"
    assert ApiError(404, "x").kind == "NotFoundError"
    assert ApiError(400, "x", kind="Custom").kind == "Custom"


# --- choices ----------------------------------------------------------------------------

def delta(seq: int, text: str, finish: str | None = None, rid: str = "cmpl-x", index: int = 0,
          tokens: list[int] | None = None, **extra) -> TextDelta:
    return TextDelta(rid, index, seq, text, tokens if tokens is not None else [seq + 100], 4,
                     finish, **extra)


def test_choice_applies_in_seq_order_once():
    choice = Choice(0)
    assert choice.offer(delta(1, "b")) == []
    assert [d.text for d in choice.offer(delta(0, "a"))] == ["a", "b"]
    assert choice.offer(delta(0, "a")) == [] and choice.offer(delta(1, "b")) == []
    assert choice.offer(delta(3, "d")) == []
    assert choice.offer(delta(3, "d")) == []  # a duplicate of an early one replaces it
    assert [d.text for d in choice.offer(delta(2, "c"))] == ["c", "d"]
    assert (choice.text, choice.token_ids, choice.num_prompt_tokens) == ("abcd",
                                                                        [100, 101, 102, 103], 4)


def test_choice_ignores_everything_after_its_finish():
    choice = Choice(0)
    choice.offer(delta(2, "late"))
    choice.offer(delta(0, "a"))
    applied = choice.offer(delta(1, "b", "stop", stop_reason="b"))
    assert [d.text for d in applied] == ["b"]  # seq 2 was waiting, and is dropped
    assert choice.finished and (choice.finish_reason, choice.stop_reason) == ("stop", "b")
    assert choice.offer(delta(3, "more")) == [] and choice.text == "ab" and not choice.early


def test_choice_counts_seq_in_tokens_and_skips_empty_deltas():
    choice = Choice(0)
    assert choice.offer(delta(0, "xy", tokens=[1, 2])) != []
    assert choice.offer(delta(2, "", tokens=[])) == []
    assert choice.offer(delta(2, "z", tokens=[3]))[0].text == "z"
    assert choice.next_seq == 3


def test_choice_keeps_prompt_logprobs_of_the_first_delta():
    rows = [None, TokenLogprobs([5, 6], [-1.0, -0.5], 2, ["a", "b"])]
    choice = Choice(0)
    choice.offer(delta(0, "a", prompt_logprobs=rows))
    choice.offer(delta(1, "b"))
    assert choice.prompt_logprobs == rows


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.text(max_size=3), min_size=1, max_size=12), seed=st.integers(0, 2**16),
       stop_at=st.integers(0, 11))
def test_choice_text_is_the_in_order_text_up_to_the_finish(texts, seed, stop_at):
    stop_at = min(stop_at, len(texts) - 1)
    deltas = [delta(i, t, "stop" if i == stop_at else None) for i, t in enumerate(texts)]
    rng = random.Random(seed)
    arrivals = deltas + rng.sample(deltas, k=len(deltas) // 2)  # duplicates
    rng.shuffle(arrivals)
    choice = Choice(0)
    applied = [d for d in arrivals for d in choice.offer(d)]
    assert [d.seq for d in applied] == list(range(stop_at + 1))
    assert choice.text == "".join(texts[:stop_at + 1]) and choice.finished


# --- logprobs objects --------------------------------------------------------------------

def lp(texts: list[str], logprobs: list[float], rank: int = 1) -> TokenLogprobs:
    return TokenLogprobs(list(range(len(texts))), logprobs, rank, texts)


def test_completion_logprobs_with_an_unscored_first_token():
    entries = [None, lp([" b", " x"], [-1.0, -0.5], 2), lp(["cd", "cd"], [-float("inf"), -2.0])]
    logprobs = responses.completion_logprobs(entries, 10, unscored_text="A")
    out = to_dict(logprobs)
    assert out == {"tokens": ["A", " b", "cd"], "token_logprobs": [None, -1.0, -9999.0],
                   "top_logprobs": [None, {" b": -1.0, " x": -0.5}, {"cd": -9999.0}],
                   "text_offset": [10, 11, 13]}
    assert responses.logprobs_text_length(logprobs) == 5
    json.dumps(out, allow_nan=False)


def test_chat_logprobs_list_the_top_k_apart_from_the_chosen_token():
    out = to_dict(responses.chat_logprobs([lp(["é", "a", "b"], [-0.1, -0.05, -3.0], 2)]))
    assert out == {"content": [{"token": "é", "logprob": -0.1, "bytes": [195, 169],
                                "top_logprobs": [
                                    {"token": "a", "logprob": -0.05, "bytes": [97]},
                                    {"token": "b", "logprob": -3.0, "bytes": [98]}]}]}


def test_logprobs_without_texts_name_the_token_ids():
    entry = TokenLogprobs([7, 8], [-1.0, -2.0], 1)
    assert responses.chat_logprobs([entry]).content[0].token == "token_id:7"


def test_prompt_logprobs_rows():
    rows = responses.prompt_logprobs([None, lp(["a", "b"], [-2.0, -1.0], 3)])
    assert [row and {k: to_dict(v) for k, v in row.items()} for row in rows] == [None, {"0": {"logprob": -2.0, "rank": 3, "decoded_token": "a"},
                           "1": {"logprob": -1.0, "rank": 1, "decoded_token": "b"}}]


def test_envelopes():
    counts = responses.usage(1, 2)
    body = to_dict(responses.envelope("id", True, 5, "m", [], stream=False,
                                      usage_counts=counts))
    assert body == {"id": "id", "object": "chat.completion", "created": 5, "model": "m",
                    "system_fingerprint": responses.SYSTEM_FINGERPRINT, "choices": [],
                    "usage": to_dict(counts)}
    assert responses.SYSTEM_FINGERPRINT.startswith("headrace-")
    chunk = to_dict(responses.envelope("id", True, 5, "m", [], stream=True))
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    chunk = to_dict(responses.envelope("id", False, 5, "m", [], stream=True))
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert to_dict(responses.usage(3, 4, 2)) == {"prompt_tokens": 3, "completion_tokens": 4,
                                        "total_tokens": 7,
                                        "prompt_tokens_details": {"cached_tokens": 2}}


# --- calls --------------------------------------------------------------------------------

def make_call(body: dict, is_chat: bool = False, echoes: list[Echo] | None = None) -> Call:
    return Call(parse_job(body, is_chat), "cmpl-x", "served", 123, 10.0, echoes)


def test_one_request_per_prompt_with_the_client_params():
    call = make_call(completion(prompt=["a", "b"], n=2, max_tokens=3, priority=1))
    requests = call.requests("gw", 55.0)
    assert [r.rid for r in requests] == ["cmpl-x-0", "cmpl-x-1"] == call.rids
    assert [r.prompt for r in requests] == ["a", "b"]
    assert all(r.params == {"n": 2, "max_tokens": 3} and r.reply_to == "gw"
               and r.priority == 1 and r.arrival_time == 55.0 for r in requests)
    tokens = make_call(completion(prompt=[5, 6])).requests("gw", 0.0)
    assert tokens[0].prompt_token_ids == [5, 6] and tokens[0].prompt is None
    chat_req, = make_call(chat(add_generation_prompt=False), is_chat=True).requests("gw", 0.0)
    assert chat_req.rid == "cmpl-x" and chat_req.messages == USER
    assert not chat_req.add_generation_prompt and chat_req.prompt is None
    assert request_ids("c", 1) == ["c"] and request_ids("c", 2) == ["c-0", "c-1"]


def test_choice_index_is_prompt_index_times_n_plus_i():
    call = make_call(completion(prompt=["a", "b"], n=2))
    for k, rid in enumerate(call.rids):
        for i in range(2):
            call.offer(delta(0, f"{rid}/{i}", "length", rid=rid, index=i,
                             num_cached_tokens=2 * k))
    assert to_dict(call.response())["usage"].get("prompt_tokens_details") is None
    call.job.prompt_tokens_details = True  # --enable-prompt-tokens-details
    body = to_dict(call.response())
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "cmpl-x-0/0"), (1, "cmpl-x-0/1"), (2, "cmpl-x-1/0"), (3, "cmpl-x-1/1")]
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert body["object"] == "text_completion" and body["model"] == "served"


def test_the_call_starts_when_every_request_answered_and_ends_when_every_choice_did():
    call = make_call(completion(prompt=["a", "b"]))
    call.offer(delta(0, "x", rid="cmpl-x-0"))
    assert not call.started and call.unfinished_rids() == ["cmpl-x-0", "cmpl-x-1"]
    call.offer(delta(0, "y", "stop", rid="cmpl-x-1"))
    assert call.started and not call.done and call.unfinished_rids() == ["cmpl-x-0"]
    assert call.offer(delta(0, "z", rid="other")) == []
    assert call.offer(delta(0, "z", rid="cmpl-x-0", index=5)) == []
    call.offer(delta(1, "x", "length", rid="cmpl-x-0"))
    assert call.finished and call.done and call.unfinished_rids() == []


def test_the_first_error_of_a_running_request_ends_the_call():
    call = make_call(completion(prompt=["a", "b"]))
    call.offer(delta(0, "done", "stop", rid="cmpl-x-0"))
    call.offer(ErrorReply("cmpl-x-0", 503, "too late"))  # that request had finished
    assert call.error is None
    call.offer(ErrorReply("cmpl-x-1", 400, "too long: 10 > 5", param="prompt"))
    call.offer(ErrorReply("cmpl-x-1", 503, "second"))
    assert call.started and call.done
    assert (call.error.status, call.error.message, call.error.param) == (400, "too long: 10 > 5",
                                                                         "prompt")


def test_chat_response_and_logprobs():
    call = make_call(chat(logprobs=True, top_logprobs=1), is_chat=True)
    call.offer(delta(0, "Hi", logprobs=[lp(["Hi", "Yo"], [-0.5, -1.0])]))
    call.offer(delta(1, "!", "stop", logprobs=[lp(["!", "."], [-0.1, -2.0])]))
    body = to_dict(call.response())
    assert body["object"] == "chat.completion" and body["id"] == "cmpl-x"
    choice, = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hi!", "refusal": None,
                                 "tool_calls": [], "reasoning_content": None}
    assert [c["token"] for c in choice["logprobs"]["content"]] == ["Hi", "!"]
    assert choice["finish_reason"] == "stop"


def test_echo_puts_the_prompt_and_its_logprobs_first():
    rows = [None, lp([" world", " there"], [-3.0, -1.0], 2)]
    call = make_call(completion(prompt="Hello world", echo=True, logprobs=1),
                     echoes=[Echo("Hello world", "Hello")])
    call.offer(delta(0, "!", "length", prompt_logprobs=rows,
                     logprobs=[lp(["!", "?"], [-0.2, -2.0])]))
    choice, = to_dict(call.response())["choices"]
    assert choice["text"] == "Hello world!"
    assert choice["logprobs"]["tokens"] == ["Hello", " world", "!"]
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -0.2]
    assert choice["logprobs"]["text_offset"] == [0, 5, 11]


def test_prompt_logprobs_without_echo_are_vllm_rows():
    call = make_call(completion(prompt_logprobs=1))
    call.offer(delta(0, "x", "length", prompt_logprobs=[None, lp(["a"], [-1.0])]))
    assert to_dict(call.response())["choices"][0]["prompt_logprobs"] == [
        None, {"0": {"logprob": -1.0, "rank": 1, "decoded_token": "a"}}]


def test_chat_chunks_start_with_the_role_and_coalesce_per_choice():
    call = make_call(chat(n=2, stream=True, stream_options={"include_usage": True}),
                     is_chat=True)
    opening = list(map(to_dict, call.opening_chunks()))
    assert [c["choices"][0]["delta"] for c in opening] == [
        {"role": "assistant", "content": ""}] * 2
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in opening)
    applied = (call.offer(delta(0, "a")) + call.offer(delta(0, "x", index=1))
               + call.offer(delta(1, "b", "stop", stop_reason=7)))
    chunks = list(map(to_dict, call.chunks(applied)))
    assert [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"],
             c["choices"][0]["stop_reason"]) for c in chunks] == [
        (0, {"content": "ab"}, "stop", 7), (1, {"content": "x"}, None, None)]
    usage = to_dict(call.usage_chunk())
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_a_step_makes_a_chunk_even_when_its_text_is_held_back():
    """As vLLM: a client sees every step's tokens arrive, also before their text is out."""
    call = make_call(completion(stream=True))
    held, = map(to_dict, call.chunks(call.offer(delta(0, ""))))
    assert held["choices"][0]["text"] == "" and held["choices"][0]["finish_reason"] is None
    chunk, = map(to_dict, call.chunks(call.offer(delta(1, "", "length"))))
    assert chunk["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                   "finish_reason": "length", "stop_reason": None}
    assert chunk["usage"] is None  # null until the usage chunk, as vLLM sends it


def test_streamed_echo_and_logprob_offsets_continue_across_chunks():
    call = make_call(completion(prompt="Hi", echo=True, logprobs=0, stream=True),
                     echoes=[Echo("Hi", "Hi")])
    first, = map(to_dict, call.chunks(call.offer(delta(0, " a", prompt_logprobs=[None],
                                          logprobs=[lp([" a"], [-1.0])]))))
    second, = map(to_dict, call.chunks(call.offer(delta(1, " b", "length",
                                                        logprobs=[lp([" b"], [-2.0])]))))
    assert first["choices"][0]["text"] == "Hi a" and second["choices"][0]["text"] == " b"
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 2]
    assert second["choices"][0]["logprobs"]["text_offset"] == [4]


def test_observe_gives_ttft_then_itl_and_e2e_with_the_finish_per_request():
    call = make_call(completion(prompt=["p", "q"]))
    seen = call.observe(call.offer(delta(0, "a", rid="cmpl-x-0")), now=10.5)
    assert (seen.ttft, seen.itl, seen.e2e) == ([("cmpl-x-0", 0.5)], [], [])
    seen = call.observe(call.offer(delta(1, "b", rid="cmpl-x-0"))
                        + call.offer(delta(0, "c", "stop", rid="cmpl-x-1")), now=11.0)
    assert seen.ttft == [("cmpl-x-1", 1.0)] and seen.itl == [("cmpl-x-0", 0.5)]
    assert (seen.e2e, seen.finish_reasons) == ([("cmpl-x-1", 1.0)], [("cmpl-x-1", "stop")])
    seen = call.observe(call.offer(delta(2, "z", "length", rid="cmpl-x-0")), now=12.0)
    assert (seen.itl, seen.e2e, seen.finish_reasons) == (
        [("cmpl-x-0", 1.0)], [("cmpl-x-0", 2.0)], [("cmpl-x-0", "length")])


# --- admission ----------------------------------------------------------------------------

def stream(name: str, length: int, *lags: int | None) -> StreamInfo:
    return StreamInfo(name, length, [GroupInfo(f"g{i}", 0, lag, "0-0")
                                     for i, lag in enumerate(lags)])


def stats(waiting: int) -> SchedulerStats:
    return SchedulerStats(1, waiting, 0.0, 0, 0, 0, 0, 0)


def test_queue_depth_adds_undelivered_entries_and_the_waiting_queue():
    streams = [stream(keys.REQUESTS, 50, 3), stream(keys.admit(), 40, 2, 5), stream("hr:detok", 9, 9)]
    assert queue_depth(streams, [stats(4)]) == 3 + 5 + 4
    # every shard's admissions and waiting queue count
    assert queue_depth(streams + [stream(keys.admit(1), 6, 6)], [stats(4), None, stats(2)]) \
        == 3 + 5 + 4 + 6 + 2
    assert queue_depth([stream(keys.REQUESTS, 7)], [None]) == 7  # no group yet: every entry waits
    assert queue_depth([stream(keys.REQUESTS, 7, None)], [None]) == 0
    assert queue_depth([], []) == 0


UP = Shard(b"epoch", True)


def test_admission():
    now = 100.0
    alive = Backend([UP], queue_depth=4, seen_at=now - 1)
    assert admission_error(alive, 4, now) is None
    full = admission_error(Backend([UP], 5, now), 4, now)
    assert full.status == 503 and "5" in full.message and "4" in full.message
    assert full.headers() == {"Retry-After": "1"}
    assert admission_error(Backend([Shard(None, True)], 0, now), 4, now).status == 503
    # one shard of two with a scheduler is enough to admit
    assert admission_error(Backend([Shard(None, False), UP], 0, now), 4, now) is None
    stale = Backend([UP], 0, now - STALE_S - 0.1)
    assert not stale.alive(now) and admission_error(stale, 4, now).status == 503
    assert "not reached Redis" in admission_error(stale, 4, now).message
    assert not Backend().alive(now)


def test_a_gateway_tells_a_lapsed_scheduler_from_redis_out_of_its_sight():
    """A slow or lossy link that keeps the gateway from Redis ends its streams with that
    reason, not with a scheduler's death that no one saw."""
    now = 100.0
    assert Backend([UP], 0, now - 1).why_down(now) is None
    assert Backend([Shard(None, True)], 0, now - 1).why_down(now) is scheduler_gone
    assert Backend([UP], 0, now - STALE_S - 0.1).why_down(now) is redis_out_of_sight
    assert "not reached Redis for 5 s" in redis_out_of_sight("r").message


@pytest.mark.parametrize("body,flag", [
    ({"prompt": ["a"] * 4}, "--max-prompts-per-request 3"),
    ({"stop": ["x"] * 3}, "--max-stop-strings 2"),
    ({"stop": "y" * 6}, "--max-stop-length 5"),
    ({"stop_token_ids": [1] * 5}, "--max-stop-token-ids 4"),
    ({"n": 3}, "--max-n 2")])
def test_what_a_call_may_ask_for_is_bounded_and_the_error_names_the_bound(body, flag):
    limits = Limits(max_prompts_per_request=3, max_stop_strings=2, max_stop_length=5,
                    max_stop_token_ids=4, max_n=2)
    with pytest.raises(ApiError) as caught:
        parse_job(completion(**body), chat=False, limits=limits)
    assert caught.value.status == 400 and flag in caught.value.message
    at_bound = {"prompt": ["a"] * 3, "stop": ["y" * 5] * 2, "stop_token_ids": [1] * 4, "n": 2}
    parse_job(completion(**at_bound), chat=False, limits=limits)


def test_the_params_published_are_the_ones_checked():
    job = parse_job(completion(temperature=2**64, top_p=1, stop="x"), chat=False)
    assert job.params["temperature"] == float(2**64) and isinstance(job.params["top_p"], float)
    assert job.params["stop"] == ["x"]
    encode(GenerateRequest("r", "g", job.params, prompt="a"))  # the bus carries it


def test_a_shard_whose_scheduler_lapsed_or_came_back_under_a_new_epoch_is_lost():
    a, b = Shard(b"epoch-a", True), Shard(b"epoch-b", True)
    before = Backend([a, a], 0, 1.0)
    assert Backend([a, b], 0, 2.0).lost_shards(before) == [(1, scheduler_restarted)]
    assert Backend([Shard(None, True), a], 0, 2.0).lost_shards(before) == [(0, scheduler_gone)]
    assert Backend([a, a], 0, 2.0).lost_shards(before) == []
    # a first sight has nothing to compare with
    assert Backend([b, b], 0, 2.0).lost_shards(Backend([Shard(), Shard()])) == []


def test_only_quiet_reply_streams_of_gateways_without_a_key_are_dead():
    now_ms = 1_000_000
    infos = [StreamInfo("hr:replies:live", 1, last_id="1-0"),
             StreamInfo("hr:replies:dead", 1, last_id="1-0"),
             StreamInfo("hr:replies:recent", 1, last_id=f"{now_ms - 5_000}-3")]
    alive = [b"live", None, None]
    assert dead_reply_streams(infos, alive, now_ms, idle_ms=60_000) == ["hr:replies:dead"]


@pytest.mark.parametrize("body", [{"priority": 2**63}, {"priority": -2**63 - 1},
                                  {"n": 2**31 - 1}, {"top_k": 2**64}])
def test_integers_the_bus_cannot_carry_or_unbounded_n_are_400(body):
    with pytest.raises(ApiError) as caught:
        parse_job({"prompt": "Hi", **body}, chat=False)
    assert caught.value.status == 400 and caught.value.param == next(iter(body))


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}


def test_tool_choice_defaults_and_forced_calls():
    assert parse_job(chat(), chat=True).tool_choice == "none"
    job = parse_job(chat(tools=[TOOL]), chat=True)
    assert (job.tool_choice, job.tools) == ("auto", [TOOL])
    assert "structured_outputs" not in job.params
    job = parse_job(chat(tools=[TOOL], tool_choice="none"), chat=True)
    assert job.tool_choice == "none" and job.tools == [TOOL]  # still in the prompt
    job = parse_job(chat(tools=[TOOL], tool_choice="required"), chat=True)
    schema = job.params["structured_outputs"]["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["f"]
    job = parse_job(chat(tools=[TOOL], tool_choice={"type": "function",
                                                    "function": {"name": "f"}}), chat=True)
    assert (job.tool_choice, job.tool_name) == ("function", "f")
    assert job.params["structured_outputs"] == {"json": TOOL["function"]["parameters"]}
    assert refused(chat(tool_choice="required"), is_chat=True).param == "tool_choice"
    assert refused(chat(tools=[TOOL], tool_choice={"type": "function", "function": {
        "name": "g"}}), is_chat=True).param == "tool_choice"
    assert refused(chat(tools=[{"type": "function"}]), is_chat=True).param == "tools"
    error = refused(chat(tools=[TOOL], tool_choice="required",
                         response_format={"type": "json_object"}), is_chat=True)
    assert "one way" in error.message
    assert not parse_job(chat(include_reasoning=False), chat=True).include_reasoning

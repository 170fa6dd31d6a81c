"""The tokenizer core: chat template, tokenization, every rejection with its status and
numbers, max_tokens resolution and the generation config's cap."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.messages import AdmitRequest, GenerateRequest, decode, encode
from common.sampling_params import SamplingParams
from common.errors import ApiError
from services.tokenizer.core import InputProcessor
from common.sampling_defaults import SamplingDefaults, sampling_defaults
from tests.text_fixtures import SMOLLM2_TOKENIZER_DIR, smollm2_tokenizer

MAX_LEN = 256
VOCAB = 49152
EOS = (2, 7)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def processor(tok, defaults: SamplingDefaults | None = None, max_len: int = MAX_LEN
              ) -> InputProcessor:
    return InputProcessor(tok, max_len, defaults or SamplingDefaults(), max_logprobs=5,
                          vocab_size=VOCAB, eos_token_ids=EOS)


def request(params: dict | None = None, **prompt) -> GenerateRequest:
    return GenerateRequest("rid-1", "gw-1", params or {}, **prompt)


def rejected(proc: InputProcessor, req: GenerateRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        proc.process(req)
    assert info.value.status == 400 and info.value.kind == "BadRequestError"
    return info.value


# --- prompts ------------------------------------------------------------------------

def test_chat_messages_get_the_chat_template(tok):
    admit = processor(tok).process(request(messages=[{"role": "user", "content": "Hi!"}]))
    text = tok.decode(admit.prompt_token_ids)
    assert "<|im_start|>user\nHi!<|im_end|>" in text
    assert text.startswith("<|im_start|>system\n")  # the template's default system turn
    assert text.endswith("<|im_start|>assistant\n")
    assert admit.prompt_token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_without_generation_prompt_the_assistant_turn_is_not_opened(tok):
    admit = processor(tok).process(GenerateRequest(
        "r", "gw", {}, messages=[{"role": "user", "content": "Hi!"}],
        add_generation_prompt=False))
    assert not tok.decode(admit.prompt_token_ids).endswith("<|im_start|>assistant\n")


def test_text_parts_are_joined_for_string_templates(tok):
    proc = processor(tok)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    ids = proc.prompt_ids(None, None, [{"role": "user", "content": parts}])
    assert ids == proc.prompt_ids(None, None, [{"role": "user", "content": "one\ntwo"}])


def test_plain_prompt_is_tokenized_as_the_tokenizer_does(tok):
    admit = processor(tok).process(request(prompt="Hello, world"))
    assert admit.prompt_token_ids == tok.encode("Hello, world")


def test_token_id_prompt_passes_through(tok):
    assert processor(tok).process(request(prompt_token_ids=[5, 6, 7])).prompt_token_ids == [
        5, 6, 7]


def test_admit_request_survives_the_wire(tok):
    admit = processor(tok).process(request({"temperature": 0.5, "stop": ["x"]},
                                           prompt="Hello"))
    assert decode(encode(admit)) == admit


# --- rejections ----------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [{"prompt": ""}, {"prompt_token_ids": []}])
def test_empty_prompt_is_rejected(tok, prompt):
    assert "empty" in rejected(processor(tok), request(**prompt)).message


@pytest.mark.parametrize("bad", [VOCAB, -1, VOCAB + 100])
def test_token_ids_out_of_range_are_rejected(tok, bad):
    error = rejected(processor(tok), request(prompt_token_ids=[1, bad, 2]))
    assert str(bad) in error.message and str(VOCAB) in error.message
    assert error.param == "prompt_token_ids"


def test_prompt_longer_than_the_context_is_rejected(tok):
    error = rejected(processor(tok), request(prompt_token_ids=[5] * 300))
    assert "maximum context length is 256 tokens" in error.message
    assert "300 input tokens" in error.message


def test_prompt_filling_the_whole_context_is_rejected(tok):
    error = rejected(processor(tok), request(prompt_token_ids=[5] * MAX_LEN))
    assert "256 input tokens" in error.message


def test_prompt_plus_max_tokens_over_the_context_is_rejected(tok):
    error = rejected(processor(tok), request({"max_tokens": 100},
                                             prompt_token_ids=[5] * 200))
    assert all(str(n) in error.message for n in (256, 300, 200, 100))
    assert error.param == "max_tokens"


@pytest.mark.parametrize("params, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"temperature": "hot"}, "temperature"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": ["a", 3]}, "stop"),
    ({"max_tokens": 2.5}, "max_tokens"),
])
def test_invalid_sampling_values_are_rejected_with_their_param(tok, params, param):
    error = rejected(processor(tok), request(params, prompt="Hello"))
    assert error.param == param and param in error.message


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_too_many_logprobs_are_rejected(tok, name):
    error = rejected(processor(tok), request({name: 6}, prompt="Hello"))
    assert error.param == name and "at most 5" in error.message


def test_unknown_parameter_names_are_rejected(tok):
    error = rejected(processor(tok), request({"temperture": 0.5}, prompt="Hello"))
    assert error.param == "temperture" and "temperture" in error.message


def test_eos_token_ids_cannot_be_set_by_a_client(tok):
    assert rejected(processor(tok), request({"eos_token_ids": [5]},
                                            prompt="Hi")).param == "eos_token_ids"


@pytest.mark.parametrize("prompt", [
    {},
    {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
])
def test_exactly_one_prompt_form_is_required(tok, prompt):
    assert "exactly one" in rejected(processor(tok), request(**prompt)).message


@pytest.mark.parametrize("messages", [
    [],
    [{"content": "no role"}],
    ["just a string"],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])
def test_malformed_messages_are_rejected(tok, messages):
    assert rejected(processor(tok), request(messages=messages)).param == "messages"


def test_chat_template_errors_are_rejected():
    strict = AutoTokenizer.from_pretrained(str(SMOLLM2_TOKENIZER_DIR))
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('conversations must start with a user') }}"
                            "{% endif %}{{ messages[0]['content'] }}")
    error = rejected(processor(strict), request(messages=[{"role": "assistant",
                                                           "content": "x"}]))
    assert "conversations must start with a user" in error.message


def test_rejection_becomes_an_error_reply(tok):
    error = rejected(processor(tok), request({"top_p": 2.0}, prompt="Hi"))
    reply = error.reply("rid-1")
    assert (reply.rid, reply.status, reply.kind, reply.param) == (
        "rid-1", 400, "BadRequestError", "top_p")
    assert reply.message == error.message


# --- sampling resolution -----------------------------------------------------------

def test_unset_max_tokens_fills_the_context(tok):
    admit = processor(tok).process(request(prompt_token_ids=[5] * 56))
    assert admit.params.max_tokens == MAX_LEN - 56
    assert admit.params.eos_token_ids == EOS


def test_max_new_tokens_caps_unset_and_explicit_max_tokens(tok):
    defaults = sampling_defaults("auto", {"max_new_tokens": 20, "temperature": 0.7})
    proc = processor(tok, defaults)
    assert proc.process(request(prompt_token_ids=[5] * 10)).params.max_tokens == 20
    assert proc.process(request({"max_tokens": 50},
                                prompt_token_ids=[5] * 10)).params.max_tokens == 20
    assert proc.process(request({"max_tokens": 8},
                                prompt_token_ids=[5] * 10)).params.max_tokens == 8
    # the cap never reaches past the context
    assert proc.process(request(prompt_token_ids=[5] * 250)).params.max_tokens == 6


def test_model_defaults_apply_and_client_values_win(tok):
    defaults = sampling_defaults("auto", {"temperature": 0.7, "top_p": 0.8})
    admit = processor(tok, defaults).process(request({"temperature": 0.2}, prompt="Hi"))
    assert (admit.params.temperature, admit.params.top_p) == (0.2, 0.8)
    assert isinstance(admit, AdmitRequest) and admit.rid == "rid-1"
    assert admit.reply_to == "gw-1"


def test_request_fields_are_carried(tok):
    req = GenerateRequest("r9", "gw-2", {}, prompt="Hi", priority=3, arrival_time=12.5)
    admit = processor(tok).process(req)
    assert (admit.rid, admit.reply_to, admit.priority, admit.arrival_time) == (
        "r9", "gw-2", 3, 12.5)


# --- the offline path --------------------------------------------------------------

def test_admit_resolves_an_already_built_params(tok):
    proc = processor(tok, sampling_defaults("auto", {"max_new_tokens": 30}))
    admit = proc.admit("r", "local", [5] * 10, SamplingParams(max_tokens=None, seed=3))
    assert admit.params.max_tokens == 30 and admit.params.seed == 3
    assert admit.params.eos_token_ids == EOS
    explicit = proc.admit("r", "local", [5] * 10, SamplingParams(max_tokens=12))
    assert explicit.params.max_tokens == 12


@pytest.mark.parametrize("ids, params, message", [
    ([5] * 200, SamplingParams(max_tokens=100), "300"),
    ([], SamplingParams(), "empty"),
    ([VOCAB], SamplingParams(), str(VOCAB)),
    ([5], SamplingParams(logprobs=9), "at most 5"),
])
def test_admit_rejects_what_process_rejects(tok, ids, params, message):
    with pytest.raises(ApiError, match=message):
        processor(tok).admit("r", "local", ids, params)


# --- vLLM's request options and tools ---------------------------------------------------

TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
    "{% if flavour is defined %}FLAVOUR {{ flavour }}\n{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object"}}}]


def test_tools_and_tool_turns_reach_the_template(tok):
    tok = smollm2_tokenizer()  # a copy of its own: the template is changed below
    tok.chat_template = TOOL_TEMPLATE
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    admit = processor(tok).process(GenerateRequest(
        "r", "gw", {}, messages=conversation, tools=TOOLS,
        chat_template_kwargs={"flavour": "x"}))
    text = tok.decode(admit.prompt_token_ids)
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "get_weather"')
    # arguments reach the template as the object, not as JSON text quoted again
    assert 'assistant: CALL get_weather {"city": "Paris"}' in text
    assert "tool: sunny" in text and "FLAVOUR x" in text and text.endswith("assistant:")


def test_truncate_prompt_tokens_keeps_the_last_tokens(tok):
    ids = tok.encode("one two three four five six seven")
    admit = processor(tok).process(request(prompt_token_ids=ids, truncate_prompt_tokens=3))
    assert admit.prompt_token_ids == ids[-3:]
    long = list(range(1, 400))
    admit = processor(tok).process(request(prompt_token_ids=long, truncate_prompt_tokens=-1))
    assert admit.prompt_token_ids == long[-(MAX_LEN - 1):]


def test_add_special_tokens_defaults_to_true_for_prompts_and_false_for_chats(tok):
    proc = processor(tok)
    assert proc.process(request(prompt="Hi", add_special_tokens=False)).prompt_token_ids \
        == tok.encode("Hi", add_special_tokens=False)
    chat = [{"role": "user", "content": "Hi"}]
    plain = proc.process(request(messages=chat)).prompt_token_ids
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert plain == tok.encode(text, add_special_tokens=False)
    assert proc.process(request(messages=chat, add_special_tokens=True)).prompt_token_ids \
        == tok.encode(text, add_special_tokens=True)


def test_logit_bias_and_allowed_token_ids_are_checked_against_the_vocabulary(tok):
    proc = processor(tok)
    admit = proc.process(request({"logit_bias": {"5": 2}, "allowed_token_ids": [5, 9]},
                                 prompt="Hello"))
    assert admit.params.logit_bias == {5: 2.0} and admit.params.allowed_token_ids == (5, 9)
    assert decode(encode(admit)) == admit
    for params in ({"logit_bias": {str(VOCAB): 1.0}}, {"allowed_token_ids": [1, VOCAB + 3]}):
        error = rejected(proc, request(params, prompt="Hello"))
        assert error.param == next(iter(params)) and "out of vocabulary" in error.message
    with pytest.raises(ApiError, match="out of vocabulary"):
        proc.admit("r", "gw", [1, 2], SamplingParams(allowed_token_ids=[VOCAB]))


def test_an_embedding_request_is_tokenized_and_may_fill_the_context(tok):
    proc = processor(tok)
    admit = proc.process(request(prompt="Hello world", embed=True))
    assert admit.embed and admit.prompt_token_ids == tok.encode("Hello world")
    full = proc.process(request(prompt_token_ids=[5] * MAX_LEN, embed=True))
    assert len(full.prompt_token_ids) == MAX_LEN and decode(encode(full)) == full
    error = rejected(proc, request(prompt_token_ids=[5] * (MAX_LEN + 1), embed=True))
    assert error.param == "input" and error.message == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{MAX_LEN + 1} tokens in the input for embedding generation. Please reduce the "
        "length of the input.")
    kept = proc.process(request(prompt_token_ids=list(range(3, MAX_LEN + 13)), embed=True,
                                truncate_prompt_tokens=-1))
    assert kept.prompt_token_ids == list(range(13, MAX_LEN + 13))  # every position

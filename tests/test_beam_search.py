"""bad_words, best_of and beam search (issue 33 item 4): the sampler's mask against a naive
one, the offline LLM against transformers on a tiny random model (CPU, float32), and the
served API through the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from common.beam_search import BeamSearch, BeamSearchParams, beam_search_score
from common.errors import ApiError
from common.messages import TextDelta, TokenLogprobs
from common.sampling_params import SamplingError, SamplingParams
from services import LLM
from services.gateway.core import Call
from services.gateway.protocol import parse_job
from services.offline.run_batch import BatchLine, BatchRun
from services.tokenizer.core import bad_words_token_ids
from services.worker.sampler import SamplingRow, apply_bad_words
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, serving, tiny_serve_args
from tests.tiny_models import make_tiny_model

VOCAB = 49152  # the test tokenizer's, so that any text is in the vocabulary
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("beam"), "llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=256)


@torch.no_grad()
def next_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)


# --- bad_words ------------------------------------------------------------------------------

def naive_banned(words, output) -> set[int]:
    """vLLM's rule, word by word: ban the last token when the rest ends the output."""
    banned = set()
    for word in words:
        *prefix, last = word
        if len(prefix) <= len(output) and (not prefix or list(output[-len(prefix):]) == prefix):
            banned.add(last)
    return banned


def test_the_bad_words_mask_equals_a_naive_one():
    rng = random.Random(0)
    vocab = 40
    for _ in range(50):
        rows = []
        for _ in range(rng.randint(1, 4)):
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
            words = tuple(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 3)))
                          for _ in range(rng.randint(0, 4)))
            if words and output and rng.random() < 0.5:  # a word that ends the output
                words += ((*output[-2:], rng.randrange(vocab)),)
            rows.append(SamplingRow(SamplingParams(bad_words_token_ids=words), [1, 2],
                                    output, None))
        logits = torch.randn(len(rows), vocab)
        out = apply_bad_words(logits, rows)
        for i, row in enumerate(rows):
            banned = naive_banned(row.params.bad_words_token_ids, row.output_token_ids)
            expected = logits[i].clone()
            expected[list(banned)] = float("-inf")
            assert torch.equal(out[i], expected)
    plain = torch.randn(2, vocab)
    rows = [SamplingRow(SamplingParams(), [], [], None)] * 2
    assert apply_bad_words(plain, rows) is plain  # nothing banned: untouched, no copy


def test_bad_words_are_spelled_with_and_without_a_leading_space(model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = bad_words_token_ids(tokenizer, ("Paris", " the cat"))
    enc = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert ids == (enc("Paris"), enc(" Paris"), enc("the cat"), enc(" the cat"))
    with pytest.raises(SamplingError) as e:
        SamplingParams(bad_words=["ok", " "])
    assert e.value.param == "bad_words"


def test_bad_words_never_appear_and_greedy_equals_a_naive_masked_search(llm, hf):
    prompt = [5, 6, 7, 8]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                  ignore_eos=True), use_tqdm=False)[0]
    tokens = plain.outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    words = [tokenizer.decode([tokens[1]]), tokenizer.decode(tokens[4:6])]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=words)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    banned = bad_words_token_ids(tokenizer, tuple(words))
    assert any(len(w) > 1 for w in banned)  # a word of several tokens is tested too
    expected: list[int] = []
    for _ in range(10):
        logprobs = next_logprobs(hf, prompt + expected)
        logprobs[list(naive_banned(banned, expected))] = float("-inf")
        expected.append(int(logprobs.argmax()))
    assert out == expected and out != tokens
    for word in banned:
        assert not any(tuple(out[i:i + len(word)]) == word for i in range(len(out)))


# --- best_of --------------------------------------------------------------------------------

def test_best_of_is_checked():
    assert SamplingParams(n=2, best_of=3).num_generated == 3
    for bad in (1, 0, "3", 10**6):
        with pytest.raises(SamplingError) as e:
            SamplingParams(n=2, best_of=bad)
        assert e.value.param == "best_of"


def test_offline_best_of_returns_the_n_of_highest_cumulative_logprob(llm, hf):
    prompt = [11, 12, 13]
    params = SamplingParams(n=2, best_of=6, temperature=1.5, max_tokens=5, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert [c.index for c in out] == [0, 1] and all(c.logprobs is None for c in out)
    for c in out:  # the score is the tokens' logprobs under the model
        ref = sum(float(next_logprobs(hf, prompt + c.token_ids[:i])[t])
                  for i, t in enumerate(c.token_ids))
        assert c.cumulative_logprob == pytest.approx(ref, abs=1e-3)
    assert out[0].cumulative_logprob >= out[1].cumulative_logprob


def delta(rid: str, index: int, token: int, logprob: float) -> TextDelta:
    return TextDelta(rid, index, 0, f"t{token}", [token], 3, "length",
                     logprobs=[TokenLogprobs([token], [logprob], 1)])


def test_a_served_best_of_keeps_the_top_n_and_counts_every_token():
    job = parse_job({"prompt": [[1, 2, 3], [4, 5, 6]], "n": 2, "best_of": 4,
                     "max_tokens": 1}, chat=False)
    call = Call(job, "cmpl-x", "m", 0, 0.0)
    (first, second) = call.requests("gw", 0.0)
    assert first.params["n"] == 4 and first.params["logprobs"] == 0
    assert "best_of" not in first.params
    scores = {first.rid: [-3.0, -0.5, -2.0, -1.0], second.rid: [-1.0, -1.0, -4.0, -0.1]}
    for rid, values in scores.items():
        for i, value in enumerate(values):
            call.offer(delta(rid, i, 10 + i, value))
    body = call.response()
    assert [(c.index, c.text, c.logprobs) for c in body.choices] == [
        (0, "t11", None), (1, "t13", None), (2, "t13", None), (3, "t10", None)]
    assert body.usage.completion_tokens == 8  # every generated token, as vLLM counts
    with pytest.raises(Exception) as e:
        parse_job({"prompt": "x", "best_of": 2, "stream": True}, chat=False)
    assert e.value.param == "best_of"


# --- beam search ----------------------------------------------------------------------------

def naive_beam_search(hf, prompt: list[int], width: int, max_tokens: int,
                      length_penalty: float = 1.0, stop: tuple[str, ...] = (),
                      decode=None) -> list[tuple[list[int], float]]:
    """Every live beam extended by its 2 * width likeliest tokens under transformers,
    the width best kept by vLLM's score; ended beams (an EOS, or generated text that
    `decode` spells with a stop string in it) wait aside."""
    def score(beam):
        return beam_search_score(beam[0], beam[1], (EOS,), length_penalty)

    def ends(tokens: list[int]) -> bool:
        return tokens[-1] == EOS or any(s in decode(tokens[len(prompt):]) for s in stop)
    live, ended = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in live:
            top = next_logprobs(hf, tokens).topk(2 * width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
                beam = (tokens + [token], cum + logprob)
                (ended if ends(beam[0]) else grown).append(beam)
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(ended + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (3, 0.5)])
def test_offline_beam_search_equals_a_naive_one_on_transformers(llm, hf, width,
                                                                length_penalty):
    prompts = [[5, 6, 7], [300, 20, 4000, 17, 9]]
    params = BeamSearchParams(beam_width=width, max_tokens=5, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        expected = naive_beam_search(hf, prompt, width, 5, length_penalty)
        assert [s.tokens for s in output.sequences] == [t for t, _ in expected]
        for seq, (_, cum) in zip(output.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
            assert seq.text == tokenizer.decode(seq.tokens)
            assert seq.finish_reason == "length" and len(seq.logprobs) == 5


def a_stop_string(tokenizer, sequences, num_prompt: int) -> str:
    """A piece of text some best beam generates in its second token or later."""
    for seq in sequences:
        for token in seq.tokens[num_prompt + 1:]:
            piece = tokenizer.decode([token], skip_special_tokens=True).strip()
            if piece:
                return piece[:3]
    raise AssertionError("no beam generated a visible piece of text")


@pytest.mark.parametrize("include", [False, True])
def test_offline_beam_search_ends_beams_at_stop_strings_as_a_naive_one(llm, hf, include):
    prompt, width = [5, 6, 7], 2
    tokenizer = llm.get_tokenizer()
    free = llm.beam_search([{"prompt_token_ids": prompt}],
                           BeamSearchParams(beam_width=width, max_tokens=5))[0].sequences
    stop = a_stop_string(tokenizer, free, len(prompt))
    params = BeamSearchParams(beam_width=width, max_tokens=5, stop=[stop],
                              include_stop_str_in_output=include)
    out = llm.beam_search([{"prompt_token_ids": prompt}], params)[0].sequences

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    expected = naive_beam_search(hf, prompt, width, 5, stop=(stop,), decode=decode)
    assert [s.tokens for s in out] == [t for t, _ in expected] != [s.tokens for s in free]
    stopped = [s for s in out if s.finish_reason == "stop"]
    assert stopped and all(s.stop_reason == stop for s in stopped)
    for seq, (_, cum) in zip(out, expected):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
        generated = decode(seq.tokens[len(prompt):])
        if seq in stopped:  # the text cut at the stop string, after it with the flag
            end = generated.index(stop) + (len(stop) if include else 0)
            assert seq.text == tokenizer.decode(prompt) + generated[:end]
        else:
            assert stop not in generated


def test_beam_search_ends_beams_at_eos_and_stops_early():
    params = BeamSearchParams(beam_width=2, max_tokens=10, early_stopping=True)
    search = BeamSearch([1], params, (EOS,))
    search.advance([{EOS: -0.1, 5: -1.0, 6: -2.0}])
    assert [b.tokens for b in search.live] == [[1, 5], [1, 6]] and not search.done
    search.advance([{EOS: -0.2, 7: -0.3}, {EOS: -5.0}])
    assert search.done  # two beams ended: early_stopping ends the search
    best = search.best()
    assert [(b.tokens, b.finish_reason) for b in best] == [([1, EOS], "stop"),
                                                           ([1, 5, 7], "length")]
    assert search.output_ids(best[0]) == []  # the EOS is not shown without the flag
    with pytest.raises(SamplingError) as e:
        BeamSearchParams(beam_width=0, max_tokens=3)
    assert e.value.param == "beam_width"
    for bad in (["ok", ""], "ok", [3]):
        with pytest.raises(SamplingError) as e:
            BeamSearchParams(beam_width=1, max_tokens=3, stop=bad)
        assert e.value.param == "stop"


def test_a_stop_string_ends_a_beam_whatever_token_completes_it():
    texts = {5: "a", 6: "b", 7: "XY", 8: "Y!"}
    decode = lambda ids: "".join(texts[t] for t in ids)  # noqa: E731
    for include, shown in ((False, "b"), (True, "bXY")):
        params = BeamSearchParams(beam_width=2, max_tokens=5, stop=["XY"],
                                  include_stop_str_in_output=include)
        search = BeamSearch([1], params, (EOS,), decode=decode)
        search.advance([{5: -0.5, 6: -0.6}])
        search.advance([{7: -0.1, 8: -0.2}, {7: -0.3, 5: -2.0}])
        # "aXY" and "bXY" end there; "aY!" and "ba" go on
        assert sorted(b.tokens for b in search.live) == [[1, 5, 8], [1, 6, 5]]
        ended = {tuple(b.tokens): b for b in search.completed}
        assert set(ended) == {(1, 5, 7), (1, 6, 7)}
        assert (ended[1, 6, 7].output_text, ended[1, 6, 7].stop_reason) == (shown, "XY")
        assert search.output_ids(ended[1, 6, 7]) == [6, 7]  # the tokens stay whole


def test_beam_search_fields_parse_into_its_params():
    job = parse_job({"prompt": "x", "n": 3, "max_tokens": 5, "use_beam_search": True,
                     "length_penalty": 2, "early_stopping": True, "temperature": 0.5},
                    chat=False)
    assert job.beam == BeamSearchParams(beam_width=3, max_tokens=5, temperature=0.5,
                                        length_penalty=2.0, early_stopping=True)
    chat = parse_job({"messages": [{"role": "user", "content": "hi"}],
                      "use_beam_search": True, "max_completion_tokens": 7}, chat=True)
    assert (chat.beam.beam_width, chat.beam.max_tokens) == (1, 7)
    plain = parse_job({"prompt": "x", "length_penalty": 1.0, "use_beam_search": False},
                      chat=False)
    assert plain.beam is None  # vLLM's defaults, sent without a beam search, mean nothing
    stops = parse_job({"prompt": "x", "use_beam_search": True, "stop": "a",
                       "include_stop_str_in_output": True}, chat=False)
    assert stops.beam.stop == ("a",) and stops.beam.include_stop_str_in_output
    for fields, param in (({"top_p": 0.5}, "top_p"), ({"seed": 3}, "seed"),
                          ({"guided_regex": "a+"}, "guided_regex"),
                          ({"prompt_logprobs": 1}, "prompt_logprobs")):
        with pytest.raises(ApiError) as e:
            parse_job({"prompt": "x", "use_beam_search": True, **fields}, chat=False)
        assert e.value.param == param


# --- served ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("beam-serve")
    with serving(tiny_serve_args(model_dir, root / "run", "--max-model-len", "256"),
                 root / "serve.log", root / "run") as server:
        yield server


@pytest.fixture
def api(served: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


def post(server: ServerProcess, path: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if not body.get("stream") else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_served_beam_search_equals_the_offline_one(api, served, llm):
    prompt = [5, 6, 7]
    out = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=3,
                                 extra_body={"use_beam_search": True, "length_penalty": 0.5})
    tokenizer = llm.get_tokenizer()
    best = llm.beam_search([{"prompt_token_ids": prompt}],
                           BeamSearchParams(beam_width=3, max_tokens=4,
                                            length_penalty=0.5))[0].sequences
    assert [c.text for c in out.choices] == [
        tokenizer.decode(s.tokens[3:], skip_special_tokens=True) for s in best]
    assert out.usage.completion_tokens == sum(len(s.tokens) - 3 for s in best)
    scored = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, n=3,
                                    logprobs=2, extra_body={"use_beam_search": True,
                                                            "length_penalty": 0.5})
    for choice, seq in zip(scored.choices, best):  # each token's logprob, and the top 2
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(seq.cum_logprob,
                                                                    abs=1e-3)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
        assert len(choice.logprobs.tokens) == len(seq.tokens) - 3
    # the chat API, streamed over raw HTTP: one chunk per beam, then [DONE]
    status, text = post(served, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2,
        "max_tokens": 3, "use_beam_search": True, "stream": True})
    assert status == 200 and text.rstrip().endswith("data: [DONE]")
    status, body = post(served, "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2,
        "max_tokens": 3, "use_beam_search": True})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    streamed = [json.loads(line[6:]) for line in text.splitlines()
                if line.startswith("data: {")]
    content = {}
    for chunk in streamed:
        for c in chunk["choices"]:
            content[c["index"]] = content.get(c["index"], "") + (c["delta"].get("content")
                                                               or "")
    assert content == {c["index"]: c["message"]["content"] for c in body["choices"]}


@pytest.mark.slow
def test_served_beam_search_ends_beams_at_stop_strings_as_the_offline_one(api, llm):
    prompt = [5, 6, 7]
    tokenizer = llm.get_tokenizer()
    free = llm.beam_search([{"prompt_token_ids": prompt}],
                           BeamSearchParams(beam_width=2, max_tokens=5))[0].sequences
    stop = a_stop_string(tokenizer, free, len(prompt))
    best = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(
        beam_width=2, max_tokens=5, stop=[stop]))[0].sequences
    out = api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, n=2,
                                 stop=[stop], extra_body={"use_beam_search": True})
    assert any(s.finish_reason == "stop" for s in best)
    assert [(c.text, c.finish_reason) for c in out.choices] == [
        (s.output_text if s.output_text is not None
         else tokenizer.decode(s.tokens[3:], skip_special_tokens=True), s.finish_reason)
        for s in best]
    assert [c.stop_reason for c in out.choices] == [s.stop_reason for s in best]


@pytest.mark.slow
def test_a_batch_line_with_beam_search_answers_as_the_server(served, llm):
    """run-batch's beam search (its rounds among the batch's other requests) against the
    served endpoint's, line by line."""
    beam = {"model": MODEL_NAME, "n": 2, "use_beam_search": True}
    lines = [BatchLine("completions", "/v1/completions",
                       {**beam, "prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2,
                        "length_penalty": 0.5, "request_id": "mine"}),
             BatchLine("plain", "/v1/completions",
                       {"model": MODEL_NAME, "prompt": [9, 10], "max_tokens": 3,
                        "temperature": 0}),
             BatchLine("chat", "/v1/chat/completions",
                       {**beam, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 3}),
             BatchLine("too wide", "/v1/completions",
                       {**beam, "prompt": [5], "n": 50, "max_tokens": 2})]
    outputs = BatchRun(llm.engine, [MODEL_NAME]).run(lines, use_tqdm=False)
    for line, output in zip(lines, outputs):
        status, expected = post(served, line.url, line.body)
        response = output["response"]
        assert (output["custom_id"], response["status_code"]) == (line.custom_id, status)
        if status != 200:
            assert response["body"]["error"]["param"] == expected["error"]["param"] == "n"
            continue
        got = response["body"]
        assert got["usage"] == expected["usage"]
        for mine, theirs in zip(got["choices"], expected["choices"], strict=True):
            logprobs = mine.pop("logprobs"), theirs.pop("logprobs")
            assert mine == theirs
            if logprobs[0] is not None:
                assert logprobs[0]["tokens"] == logprobs[1]["tokens"]
                assert logprobs[0]["token_logprobs"] == pytest.approx(
                    logprobs[1]["token_logprobs"], abs=1e-3)
    assert outputs[0]["response"]["body"]["id"] == "cmpl-mine"


@pytest.mark.slow
def test_served_best_of_and_bad_words(api, served, llm):
    out = api.completions.create(model=MODEL_NAME, prompt=[9, 10, 11], max_tokens=4,
                                 best_of=3, temperature=1.0,
                                 extra_body={"ignore_eos": True})
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    assert out.usage.completion_tokens == 12  # the three generated completions
    greedy = dict(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0.0,
                  extra_body={"ignore_eos": True})
    plain = api.completions.create(**greedy).choices[0].text
    tokens = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8,
                                                         ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    word = next(w for w in map(tokenizer.decode, ([t] for t in tokens))  # one vLLM bans
                if any(ids[-1] in tokens for ids in bad_words_token_ids(tokenizer, (w,))))
    greedy["extra_body"] = {"ignore_eos": True, "bad_words": [word]}
    banned = api.completions.create(**greedy).choices[0].text
    offline = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8,
                                                          ignore_eos=True, bad_words=[word]),
                           use_tqdm=False)[0].outputs[0].text
    assert banned == offline and banned != plain


@pytest.mark.slow
@pytest.mark.parametrize("fields,param", [
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "seed": 1}, "seed"),
    ({"use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"use_beam_search": True, "response_format": {"type": "json_object"}},
     "response_format"),
    ({"length_penalty": 0.7}, "length_penalty"),
    ({"logits_processors": ["x"]}, "logits_processors"),
    ({"cache_salt": "s"}, "cache_salt"),
])
def test_fields_this_server_cannot_honour_are_400s_naming_them(served, fields, param):
    status, body = post(served, "/v1/completions",
                        {"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 2, **fields})
    assert status == 400 and body["error"]["param"] == param, body

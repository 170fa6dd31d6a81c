"""`headrace run-batch`: a batch file of 200 requests (chat, completions, embeddings, score
and rerank, mixed) on a tiny model, each output line OpenAI's batch output whose body holds
what the offline LLM gives for the same request (for score and rerank: the cosine
similarities of the offline LLM's embeddings, computed here); lines the server would refuse are answered with
its status and error; malformed files are refused whole, naming the line."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from services import LLM, SamplingParams
from services.cli import main as cli
from services.offline.run_batch import read_batch
from tests.tiny_models import make_tiny_model

WORDS = "the a river stone light quiet north seven under green market old".split()
# the whole vocabulary of the tiny models' tokenizer (Qwen3's), for text and chat templates
VOCAB = 151936
ENGINE = ["--dtype", "float32", "--block-size", "4", "--num-gpu-blocks-override", "1024"]


def batch_lines(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def words() -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(2, 9)))
    lines = []
    for i in range(count):
        text = words()
        kind = i % 5
        if kind == 0:
            url, body = "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": text}],
                "max_completion_tokens": rng.randint(1, 6), "temperature": 0}
        elif kind == 1:
            url, body = "/v1/completions", {"model": "tiny", "prompt": text,
                                            "max_tokens": rng.randint(1, 6), "temperature": 0}
        elif kind == 2:
            url, body = "/v1/embeddings", {"model": "tiny", "input": text}
        elif kind == 3:
            url, body = "/v1/score", {"model": "tiny", "text_1": text,
                                      "text_2": [words(), words()]}
        else:
            url, body = "/v1/rerank", {"model": "tiny", "query": text,
                                       "documents": [words() for _ in range(3)], "top_n": 2}
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return lines


def write_lines(path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("batch"), "qwen3", vocab_size=VOCAB)


def test_a_mixed_batch_answers_what_the_offline_llm_does(model_dir, tmp_path, capsys):
    lines = batch_lines(200)
    refused = [
        {"custom_id": "bad-model", "url": "/v1/completions",
         "body": {"model": "other", "prompt": "hi"}},
        {"custom_id": "bad-body", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}},
        {"custom_id": "stream", "url": "/v1/completions",
         "body": {"prompt": "hi", "stream": True}},
        {"custom_id": "beam", "url": "/v1/completions",  # beam search ignores top_p
         "body": {"prompt": "hi", "use_beam_search": True, "top_p": 0.5}}]
    write_lines(tmp_path / "in.jsonl", lines[:100] + refused + lines[100:])
    assert cli(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                str(tmp_path / "out.jsonl"), "--model", str(model_dir),
                "--served-model-name", "tiny", *ENGINE]) == 0
    assert "Running batch" in capsys.readouterr().err  # the progress bar
    out = [json.loads(row) for row in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [line["custom_id"] for line in
                                             lines[:100] + refused + lines[100:]]
    by_id = {o["custom_id"]: o for o in out}
    assert {name: by_id[name]["response"]["status_code"] for name in
            ("bad-model", "bad-body", "stream", "beam")} == {
                "bad-model": 404, "bad-body": 400, "stream": 400, "beam": 400}
    assert by_id["bad-body"]["response"]["body"]["error"]["param"] == "temperature"
    assert by_id["beam"]["response"]["body"]["error"]["param"] == "top_p"

    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=1024)
    references = offline_answers(llm, lines)
    for line, ref in zip(lines, references):
        got = by_id[line["custom_id"]]
        assert got["error"] is None and got["id"].startswith("batch_req_")
        response = got["response"]
        assert response["status_code"] == 200, response
        body = response["body"]
        assert response["request_id"] == body["id"] and body["model"] == "tiny"
        if line["url"] == "/v1/embeddings":
            assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
            assert body["data"][0]["embedding"] == pytest.approx(ref.outputs.embedding,
                                                                 abs=1e-5)
            continue
        if line["url"] == "/v1/score":
            assert [d["score"] for d in body["data"]] == pytest.approx(ref, abs=1e-5)
            continue
        if line["url"] == "/v1/rerank":
            order = sorted(range(len(ref)), key=lambda i: -ref[i])[:2]
            assert [r["index"] for r in body["results"]] == order
            assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
                [ref[i] for i in order], abs=1e-5)
            continue
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text == ref.outputs[0].text
        assert choice["finish_reason"] == ref.outputs[0].finish_reason
        assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)


def offline_answers(llm: LLM, lines: list[dict]) -> list:
    """The offline LLM's output for each line's request (one call per kind)."""
    by_url: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        by_url.setdefault(line["url"], []).append(i)
    answers: list = [None] * len(lines)
    bodies = {url: [lines[i]["body"] for i in rows] for url, rows in by_url.items()}
    chats = llm.chat([b["messages"] for b in bodies["/v1/chat/completions"]],
                     [SamplingParams(temperature=0.0, max_tokens=b["max_completion_tokens"])
                      for b in bodies["/v1/chat/completions"]], use_tqdm=False)
    texts = llm.generate([b["prompt"] for b in bodies["/v1/completions"]],
                         [SamplingParams(temperature=0.0, max_tokens=b["max_tokens"])
                          for b in bodies["/v1/completions"]], use_tqdm=False)
    embeddings = llm.embed([b["input"] for b in bodies["/v1/embeddings"]], use_tqdm=False)
    pairs = [(b["text_1"], t) for b in bodies["/v1/score"] for t in b["text_2"]]
    pairs += [(b["query"], d) for b in bodies["/v1/rerank"] for d in b["documents"]]
    texts_to_embed = sorted({t for pair in pairs for t in pair})
    vectors = {t: np.asarray(out.outputs.embedding, np.float64) for t, out in
               zip(texts_to_embed, llm.embed(texts_to_embed, use_tqdm=False))}

    def cosine(a: str, b: str) -> float:
        x, y = vectors[a], vectors[b]
        return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
    score = [[cosine(b["text_1"], t) for t in b["text_2"]] for b in bodies["/v1/score"]]
    rerank = [[cosine(b["query"], d) for d in b["documents"]] for b in bodies["/v1/rerank"]]
    for url, outputs in (("/v1/chat/completions", chats), ("/v1/completions", texts),
                         ("/v1/embeddings", embeddings), ("/v1/score", score),
                         ("/v1/rerank", rerank)):
        for i, output in zip(by_url[url], outputs):
            answers[i] = output
    return answers


@pytest.mark.parametrize("row, words", [
    ("not json", "line 2 is not JSON"),
    ('{"url": "/v1/completions", "body": {}}', "line 2 needs a string 'custom_id'"),
    ('{"custom_id": "x", "url": "/v1/audio", "body": {}}', "url '/v1/audio' is not one of"),
    ('{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}', "POST"),
    ('{"custom_id": "x", "url": "/v1/completions", "body": []}', "JSON object 'body'"),
])
def test_a_malformed_line_refuses_the_file_naming_it(row, words):
    first = json.dumps({"custom_id": "ok", "url": "/v1/completions", "body": {"prompt": "a"}})
    with pytest.raises(ValueError, match="in.jsonl line 2") as info:
        read_batch(first + "\n" + row + "\n", "in.jsonl")
    assert words in str(info.value)

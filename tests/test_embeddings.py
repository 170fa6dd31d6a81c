"""Embeddings (/v1/embeddings, LLM.embed): the pooler over chunks, the request body and the
gateway's call, and the offline engine against transformers on the same weights (LAST and
MEAN pooling, normalized or not, prompts longer than the step's budget, a batch mixed with
generation). The served path through the openai client is in tests/test_e2e.py."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.errors import ApiError
from common.messages import ErrorReply, TextDelta
from common.sampling_params import SamplingParams
from services import LLM
from services.gateway.embeddings import EmbeddingCall, check_dimensions, encoded
from services.gateway.openapi import openapi_document
from services.gateway.protocol import Limits, parse_embedding
from services.gateway.response_bodies import to_dict
from services.worker.pooler import Pooler
from tests.tiny_models import make_tiny_model

# --- the pooler ---------------------------------------------------------------------------


def pooled(pooler: Pooler, hidden: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """A prompt's embedding, its hidden states arriving in chunks of these sizes, each in a
    batch of its own beside other rows (as a step lays them out)."""
    running, first = None, 0
    for count in chunks:
        batch = torch.cat([torch.randn(3, hidden.shape[1]), hidden[first:first + count],
                           torch.randn(2, hidden.shape[1])])
        running = pooler.add_chunk(batch, 3, count, running)
        first += count
    return pooler.normalized(pooler.finish(batch, 3 + count - 1, running, first)[None])[0]


@pytest.mark.parametrize("chunks", [[10], [4, 4, 2], [1] * 10, [9, 1]])
def test_the_pooler_pools_across_chunks(chunks):
    hidden = torch.randn(10, 16, dtype=torch.bfloat16)
    whole = hidden.float()
    last = pooled(Pooler("LAST", True), hidden, chunks)
    torch.testing.assert_close(last, F.normalize(whole[-1], dim=-1))
    mean = pooled(Pooler("MEAN", True), hidden, chunks)
    torch.testing.assert_close(mean, F.normalize(whole.mean(0), dim=-1))
    raw = pooled(Pooler("MEAN", False), hidden, chunks)
    torch.testing.assert_close(raw, whole.mean(0))
    assert mean.dtype == torch.float32 and abs(mean.norm().item() - 1.0) < 1e-5


# --- the request body and the gateway's call ---------------------------------------------


def embedding_body(**fields) -> dict:
    return {"model": "m", "input": "Hello", **fields}


@pytest.mark.parametrize("given, inputs", [
    ("Hello", ["Hello"]),
    (["a", "b"], ["a", "b"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
def test_input_takes_openais_four_shapes(given, inputs):
    job = parse_embedding(embedding_body(input=given))
    assert job.inputs == inputs and job.encoding_format == "float" and job.dimensions is None


def test_vllms_options_and_unknown_fields():
    job = parse_embedding(embedding_body(encoding_format="base64", dimensions=64, user="u",
                                         truncate_prompt_tokens=5, add_special_tokens=False,
                                         priority=-2, embed_dtype="float32",
                                         endianness="native", pooling="x"))
    assert (job.encoding_format, job.dimensions, job.truncate_prompt_tokens,
            job.add_special_tokens) == ("base64", 64, 5, False)
    assert job.ignored == ["pooling"]
    assert {r.priority for r in EmbeddingCall(job, "e", "m", 1).requests("gw", 1.0)} == {-2}


@pytest.mark.parametrize("name, value", [
    ("normalize", True), ("normalize", False), ("embed_dtype", "float16"),
    ("endianness", "big"), ("mm_processor_kwargs", {"x": 1}), ("additional_data", {"a": 1})])
def test_vllm_fields_this_server_cannot_honour_are_refused_by_name(name, value):
    """normalize is the server's --override-pooler-config, not a request's to change."""
    with pytest.raises(ApiError) as info:
        parse_embedding(embedding_body(**{name: value}))
    assert info.value.status == 400 and info.value.param == name
    assert "not supported" in info.value.message


@pytest.mark.parametrize("body, param, words", [
    (embedding_body(input=""), "input", "non-empty"),
    (embedding_body(input=[]), "input", "non-empty"),
    (embedding_body(input=[[]]), "input", "none of them empty"),
    (embedding_body(input=["a", ""]), "input", "none of them empty"),
    (embedding_body(input=[1.5]), "input", "list of token ids"),
    (embedding_body(input=[-1]), "input", "token ids are integers"),
    ({"model": "m"}, "input", "'input' is required"),
    (embedding_body(encoding_format="int8"), "encoding_format", "encoding_format"),
    (embedding_body(dimensions="64"), "dimensions", "must be an integer"),
    (embedding_body(truncate_prompt_tokens=-2), "truncate_prompt_tokens", "-1"),
    (embedding_body(input=["a"] * 3), "input", "--max-prompts-per-request 2"),
])
def test_bad_bodies_are_400s_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as info:
        parse_embedding(body, Limits(max_prompts_per_request=2))
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


def test_dimensions_other_than_the_models_are_refused():
    check_dimensions(None, 64)
    check_dimensions(64, 64)
    with pytest.raises(ApiError, match="matryoshka") as info:
        check_dimensions(32, 64)
    assert info.value.param == "dimensions" and "'dimensions' is 32" in info.value.message


def answer(rid: str, vector: list[float], prompt_tokens: int) -> TextDelta:
    return TextDelta(rid, 0, 0, "", [], prompt_tokens, "stop",
                     embedding=np.asarray(vector, "<f4").tobytes())


def test_the_call_answers_each_input_in_order_as_floats_or_base64():
    job = parse_embedding(embedding_body(input=[[7], [5, 6]]))
    call = EmbeddingCall(job, "embd-1", "m", 123)
    requests = call.requests("gw", 1.0)
    assert [r.embed for r in requests] == [True, True] and call.rids == ["embd-1-0", "embd-1-1"]
    assert [r.prompt_token_ids for r in requests] == [[7], [5, 6]]
    text, = EmbeddingCall(parse_embedding(embedding_body()), "e", "m", 1).requests("gw", 1.0)
    assert (text.rid, text.prompt, text.embed) == ("e", "Hello", True)
    assert call.offer(answer("embd-1-1", [0.25, -1.5], 2)) is not None
    assert call.offer(answer("embd-1-1", [9.0, 9.0], 2)) is None  # a delivery again
    assert call.offer(answer("other", [1.0, 1.0], 2)) is None
    assert not call.done and call.unfinished_rids() == ["embd-1-0"]
    call.offer(answer("embd-1-0", [1.0, 0.1], 3))
    body = to_dict(call.response())
    assert call.done and body["object"] == "list" and body["id"] == "embd-1"
    assert body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][1] == {"object": "embedding", "index": 1, "embedding": [0.25, -1.5]}
    assert body["data"][0]["embedding"] == pytest.approx([1.0, 0.1])
    job.encoding_format = "base64"
    data = to_dict(call.response())["data"]
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() for d in data]
    assert decoded == [d["embedding"] for d in body["data"]]
    assert encoded(np.asarray([1.0], "<f4").tobytes(), "base64") == "AACAPw=="


def test_openapi_documents_the_route():
    doc = openapi_document("0")
    route = doc["paths"]["/v1/embeddings"]["post"]
    schemas = doc["components"]["schemas"]
    body = route["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert {"input", "encoding_format", "dimensions", "truncate_prompt_tokens"} <= set(
        schemas[body.rsplit("/", 1)[1]]["properties"])
    answer = route["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert set(schemas[answer.rsplit("/", 1)[1]]["properties"]) == {
        "id", "object", "created", "model", "data", "usage"}


def test_an_error_of_an_unanswered_input_ends_the_call():
    call = EmbeddingCall(parse_embedding(embedding_body(input=["a", "b"])), "embd-2", "m", 1)
    call.offer(answer("embd-2-0", [1.0], 1))
    call.offer(ErrorReply("embd-2-0", 400, "late"))  # answered already: no matter
    assert call.error is None
    call.offer(ErrorReply("embd-2-1", 400, "too long", param="input"))
    assert call.done and call.error.message == "too long" and call.error.param == "input"


# --- the engine against transformers -----------------------------------------------------

BUDGET = 8  # tokens a step: the longer prompts are prefilled in chunks


def token_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 11, 25, 6, 1)]


def hf_embedding(hf, prompt: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
        # transformers' last hidden state is after the final norm, as the pooler's input
        torch.testing.assert_close(out.hidden_states[-1],
                                   hf.model(torch.tensor([prompt])).last_hidden_state)
    hidden = out.hidden_states[-1][0]
    vector = hidden[-1] if pooling == "LAST" else hidden.mean(0)
    return F.normalize(vector, dim=-1) if normalize else vector


def tiny_llm(model_dir, **engine_args) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_num_batched_tokens=BUDGET,
               max_num_seqs=4, block_size=4, num_gpu_blocks_override=64, **engine_args)


@pytest.mark.parametrize("arch, engine_args, pooling, normalize", [
    ("llama", {}, "LAST", True),
    ("llama", {"pooling_type": "MEAN"}, "MEAN", True),
    ("qwen3", {"override_pooler_config": '{"pooling_type": "MEAN", "normalize": false}'},
     "MEAN", False),
])
def test_embeddings_equal_transformers(arch, engine_args, pooling, normalize, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path, arch)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = tiny_llm(model_dir, **engine_args)
    prompts = token_prompts()
    outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.finished and output.prompt_token_ids == prompt
        expected = hf_embedding(hf, prompt, pooling, normalize)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected,
                                   atol=1e-5, rtol=1e-5)
    assert llm.engine.scheduler.kv.usage == 0.0
    # the prefix cache now holds these prompts' blocks: an embedding computes them again
    stats = llm.engine.scheduler.kv.stats
    hits = stats.hits
    again = llm.embed({"prompt_token_ids": prompts[2]}, use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(again.outputs.embedding),
                               torch.tensor(outputs[2].outputs.embedding))
    assert stats.hits == hits
    llm.generate([prompts[2]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert stats.hits > hits  # where a completion takes the hit


def test_a_batch_mixed_with_generation_leaves_generation_unchanged(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = tiny_llm(model_dir, pooling_type="MEAN")
    prompts = token_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    plans: list = []
    engine.on_plan = plans.append
    for i, prompt in enumerate(prompts):  # each prompt twice: as a completion, embedded
        engine.add_request(f"g{i}", prompt, params)
        engine.add_embedding(f"e{i}", prompt)
    tokens: dict[str, list[int]] = {}
    embeddings: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.embedding is not None:
                embeddings[delta.rid] = np.frombuffer(delta.embedding, "<f4").tolist()
            tokens.setdefault(delta.rid, []).extend(delta.token_ids)
    assert any({r[0] for r in plan.req_ids} == {"g", "e"} for plan in plans)  # steps mixed
    assert [tokens[f"g{i}"] for i in range(len(prompts))] == alone
    for i, prompt in enumerate(prompts):
        assert tokens[f"e{i}"] == []  # nothing sampled
        torch.testing.assert_close(torch.tensor(embeddings[f"e{i}"]),
                                   hf_embedding(hf, prompt, "MEAN", True), atol=1e-5, rtol=1e-5)
    assert engine.scheduler.kv.usage == 0.0


def test_an_embedding_may_fill_the_context_and_no_more(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama")
    llm = tiny_llm(model_dir, max_model_len=32)
    full = llm.embed([list(range(3, 35))], use_tqdm=False)[0]
    assert len(full.prompt_token_ids) == 32 and len(full.outputs.embedding) == 64
    with pytest.raises(ApiError, match="33 tokens in the input for embedding") as info:
        llm.embed([list(range(3, 36))], use_tqdm=False)
    assert info.value.param == "input" and "maximum context length is 32" in info.value.message
    kept = llm.embed([list(range(3, 40))], use_tqdm=False, truncate_prompt_tokens=-1)[0]
    assert kept.prompt_token_ids == list(range(8, 40))

"""LoRA adapters through `headrace serve`: --lora-modules, the adapter registry the
gateways share in Redis, requests under an adapter's name (completions checked against the
offline LLM's tokens, embeddings against PEFT's merged weights; /tokenize and /detokenize
with the base tokenizer), /v1/models, and loading and unloading adapters at runtime; one
real server of a tiny llama for the module, driven by the official `openai` client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from common.bus import Bus
from common.config import ConfigError, EngineConfig, ServerConfig
from common.errors import ApiError
from common.lora import LoRAModule, parse_lora_module
from common.messages import GenerateRequest, LoRARequest
from common.sampling_params import SamplingParams
from services import LLM
from services.launcher import check_lora_modules
from services.gateway.adapters import Adapter, Adapters, check_new_name, named
from services.tokenizer.core import InputProcessor
from common.sampling_defaults import SamplingDefaults
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, serving, tiny_serve_args
from tests.test_embeddings import hf_embedding
from tests.test_lora import ADAPTERS, make_adapter, merged_model
from tests.tiny_models import make_tiny_model

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8]]
MAX_TOKENS = 8


# --- --lora-modules -------------------------------------------------------------------

def test_lora_modules_take_vllms_two_spellings():
    assert parse_lora_module("a=/x/y") == LoRAModule("a", "/x/y")
    assert parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == \
        LoRAModule("b", "/p", "m")
    config = EngineConfig(model="m", enable_lora=True,
                          lora_modules=["a=/x", '{"name": "b", "path": "/y"}'])
    assert config.loras() == [LoRAModule("a", "/x"), LoRAModule("b", "/y")]


@pytest.mark.parametrize("modules, enable, words", [
    (["a=/x"], False, "needs --enable-lora"),
    (["a"], True, "name=path"),
    (["=/x"], True, "name=path"),
    (['{"name": "a"}'], True, "JSON object"),
    (['{"name": "a", "path": "/x", "rank": 4}'], True, "JSON object"),
    (["{not json"], True, "not JSON"),
    (["a=/x", "a=/y"], True, "twice"),
])
def test_bad_lora_modules_are_refused(modules, enable, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(model="m", enable_lora=enable, lora_modules=modules)


# --- the registry's core --------------------------------------------------------------

def test_an_adapter_round_trips_and_unloads_by_name_or_id():
    a = Adapter(LoRARequest("a", 1, "/x"), "base")
    b = Adapter(LoRARequest("b", 2, "/y"), "other")
    assert Adapter.from_json(a.to_json().encode()) == a
    adapters = {"a": a, "b": b}
    assert named(adapters, "b", None) == b
    assert named(adapters, None, 1) == a
    assert named(adapters, "b", 2) == b
    for name, lora_int_id in (("c", None), (None, 3), ("a", 2)):
        with pytest.raises(ApiError) as info:
            named(adapters, name, lora_int_id)
        assert info.value.status == 404
    with pytest.raises(ApiError) as info:
        named(adapters, None, None)
    assert info.value.status == 400
    with pytest.raises(ApiError, match="base model"):
        check_new_name("base", ["base"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("lora-serve")
    model_dir = make_tiny_model(root, "llama")
    adapters = [make_adapter(model_dir, root / f"a{i}", i, *spec)
                for i, spec in enumerate(ADAPTERS[:2])]
    return model_dir, adapters


@pytest.mark.anyio
async def test_the_registry_gives_each_load_its_own_id(redis_url, tiny):
    _, (path_a, path_b) = tiny
    async with Bus(redis_url) as bus:
        adapters = Adapters(bus, "base", max_rank=16)
        await adapters.register([LoRAModule("a", path_a)], ["base"])
        await adapters.register([LoRAModule("a", path_a)], ["base"])  # a second gateway
        first = (await adapters.get("a")).lora
        assert await adapters.load("b", path_b, "other")
        assert not await adapters.load("b", path_a)
        assert (await adapters.unload("b", None)).lora.lora_path == path_b
        assert await adapters.load("b", path_a)
        every = await adapters.all()
        assert every["a"].lora == first and every["b"].parent == "base"
        assert len({a.lora.lora_int_id for a in every.values()}) == 2
        assert every["b"].lora.lora_int_id > first.lora_int_id + 1  # never reused
        with pytest.raises(ApiError, match="cannot read adapter_config.json"):
            await adapters.load("c", "/no/such/adapter")


def test_serve_refuses_a_bad_adapter_before_starting_anything(tiny):
    model_dir, (path_a, _) = tiny

    def check(modules: list[str], served: list[str]) -> None:
        check_lora_modules(EngineConfig(model=str(model_dir), enable_lora=True,
                                        lora_modules=modules),
                           ServerConfig(served_model_name=served))
    check([f"a={path_a}"], [])
    with pytest.raises(ConfigError, match="cannot read adapter_config.json"):
        check(["a=/no/such/adapter"], [])
    with pytest.raises(ConfigError, match="base model's name"):
        check([f"m={path_a}"], ["m"])


# --- the tokenizer --------------------------------------------------------------------

def test_the_tokenizer_checks_the_adapter_and_passes_it_on(tiny):
    from transformers import AutoTokenizer
    model_dir, (path_a, _) = tiny
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def processor(max_lora_rank: int | None) -> InputProcessor:
        return InputProcessor(tokenizer, 64, SamplingDefaults(), 5, 512, (2,), max_lora_rank)

    def request(lora: LoRARequest, embed: bool) -> GenerateRequest:
        return GenerateRequest("r", "gw", {}, prompt_token_ids=[5, 6], lora=lora,
                               embed=embed)

    good, bad = LoRARequest("a", 1, path_a), LoRARequest("bad", 2, "/no/such/adapter")
    for embed in (False, True):  # a completion, and an embedding
        admit = processor(16).process(request(good, embed))
        assert admit.lora == good and admit.embed == embed
        for proc, lora, words in ((processor(16), bad, "'bad'.*cannot read"),
                                  (processor(4), good, "rank 8 is above"),
                                  (processor(None), good, "without --enable-lora")):
            with pytest.raises(ApiError, match=words) as info:
                proc.process(request(lora, embed))
            assert info.value.status == 400


# --- a served tiny llama --------------------------------------------------------------

@pytest.fixture(scope="module")
def served_lora(tiny, tmp_path_factory) -> Iterator[ServerProcess]:
    model_dir, (path_a, _) = tiny
    root = tmp_path_factory.mktemp("serve-lora")
    args = tiny_serve_args(model_dir, root / "run", "--enable-lora", "--lora-modules",
                           f"a={path_a}", '{"name": "a2", "path": "%s"}' % path_a)
    with serving(args, root / "serve.log", root / "run") as server:
        yield server


@pytest.fixture
def client(served_lora) -> openai.OpenAI:
    return openai.OpenAI(base_url=served_lora.url + "/v1", api_key=API_KEY, max_retries=0)


def offline(model_dir: Path, lora: LoRARequest | None) -> list[str]:
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
    return [out.outputs[0].text for out in outputs]


def served_texts(client: openai.OpenAI, model: str) -> list[str]:
    response = client.completions.create(model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    assert response.model == model
    return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]


def post(server: ServerProcess, path: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(
        f"{server.url}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_completions_under_an_adapter_match_the_offline_engine(tiny, client):
    model_dir, (path_a, _) = tiny
    want = offline(model_dir, LoRARequest("a", 1, path_a))
    assert served_texts(client, "a") == want
    assert served_texts(client, "a2") == want
    assert served_texts(client, MODEL_NAME) == offline(model_dir, None) != want
    stream = client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"a"}
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == want[0]


def test_embeddings_under_an_adapter_match_its_merged_weights(tiny, client):
    model_dir, (path_a, _) = tiny

    def served(model: str) -> torch.Tensor:
        response = client.embeddings.create(model=model, input=PROMPTS)
        assert response.model == model
        return torch.tensor([item.embedding for item in response.data])
    for model, path in (("a", path_a), (MODEL_NAME, None)):
        reference = merged_model(model_dir, path)
        want = torch.stack([hf_embedding(reference, p, "LAST", True) for p in PROMPTS])
        torch.testing.assert_close(served(model), want, atol=1e-5, rtol=1e-5)
    assert (served("a2") == served("a")).all()
    assert (served("a") - served(MODEL_NAME)).abs().amax() > 1e-3
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="nope", input=PROMPTS)


def test_tokenize_and_detokenize_take_an_adapters_name(served_lora):
    """An adapter's text is the base tokenizer's, as in vLLM."""
    def tokens(model: str) -> tuple[int, dict]:
        status, text = post(served_lora, "/tokenize", {"model": model, "prompt": "Hi there"})
        return status, json.loads(text)
    status, base = tokens(MODEL_NAME)
    assert status == 200 and tokens("a") == (200, base)
    assert post(served_lora, "/detokenize", {"model": "a", "tokens": base["tokens"]}) == \
        post(served_lora, "/detokenize", {"model": MODEL_NAME, "tokens": base["tokens"]})
    for path, body in (("/tokenize", {"model": "nope", "prompt": "Hi"}),
                       ("/detokenize", {"model": "nope", "tokens": [5]})):
        status, text = post(served_lora, path, body)
        assert status == 404 and "does not exist" in json.loads(text)["error"]["message"]


def test_models_list_the_adapters(tiny, client):
    _, (path_a, _) = tiny
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "a", "a2"}
    assert cards["a"].root == path_a and cards["a"].parent == MODEL_NAME


def test_adapters_load_and_unload_at_runtime(tiny, client, served_lora):
    model_dir, (path_a, path_b) = tiny
    assert post(served_lora, "/v1/load_lora_adapter",
                {"lora_name": "b", "lora_path": path_b}) == \
        (200, "Success: LoRA adapter 'b' added successfully.")
    assert served_texts(client, "b") == offline(model_dir, LoRARequest("b", 7, path_b))
    for body, words in (({"lora_name": "b", "lora_path": path_b}, "already loaded"),
                        ({"lora_name": "c", "lora_path": "/no/such"}, "adapter_config.json"),
                        ({"lora_name": "c"}, "'lora_path' is required"),
                        ({"lora_name": MODEL_NAME, "lora_path": path_b}, "base model")):
        status, text = post(served_lora, "/v1/load_lora_adapter", body)
        assert status == 400 and words in json.loads(text)["error"]["message"]
    assert post(served_lora, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 200
    assert post(served_lora, "/v1/unload_lora_adapter", {"lora_name": "b"})[0] == 404
    with pytest.raises(openai.NotFoundError):
        served_texts(client, "b")
    assert "b" not in {card.id for card in client.models.list().data}

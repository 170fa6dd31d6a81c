"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and
`LLM(model=...).embed(prompts)`, as in vLLM.

An LLM holds its engine's ranks (and, at a tensor-parallel size above 1, the process's
torch.distributed group) until `close()`, the end of a `with LLM(...)` block, or its
collection, whichever comes first: then a script can build the next one."""

from __future__ import annotations

import itertools
import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from common.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from common.config import ConfigError, EngineConfig
from common.messages import ImageInput, LoRARequest, TextDelta, TokenLogprobs
from common.sampling_params import RequestOutputKind, SamplingParams, best_of_indices
from services.offline.engine import Engine, fewer_collections

PromptInput = str | list[int] | dict[str, Any]
# a prompt's text (None for token ids), its token ids and its processed images
Encoded = tuple[str | None, list[int], list[ImageInput]]


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsDict = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[LogprobsDict | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished() for c in self.outputs)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = False


class LLM:
    def __init__(self, model: str, *, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                 **engine_args: Any) -> None:
        """The parallel sizes are vLLM's: the data-parallel size must be 1."""
        check_offline_sizes(data_parallel_size)
        if isinstance(engine_args.get("speculative_config"), dict):  # vLLM takes a dict
            engine_args["speculative_config"] = json.dumps(engine_args["speculative_config"])
        self.engine = Engine(EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size,
                                          pipeline_parallel_size=pipeline_parallel_size,
                                          **engine_args))
        # a bound method of the engine, not of self: the LLM can still be collected
        self._release = weakref.finalize(self, self.engine.close)
        self._ids = itertools.count()

    def close(self) -> None:
        """Let the engine's ranks and process group go (a second call does nothing)."""
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.info.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.info.defaults.default_params()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None) per prompt."""
        encoded = [self._encode(p) for p in _as_list(prompts)]
        return self._run(encoded, sampling_params, use_tqdm, priority,
                         _per_prompt_lora(lora_request, len(encoded)))

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True
             ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.engine.processor
        encoded = [(None, *processor.chat_images(
            processor.prompt_ids(None, None, list(conv), add_generation_prompt), list(conv)))
            for conv in conversations]
        return self._run(encoded, sampling_params, use_tqdm, None)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput],
                    params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's (its argument order): each prompt's beam_width best beams
        (common/beam_search.py), each with the prompt's and its own tokens and their text.
        Every round runs the live beams of all prompts as one batch of one-token
        requests."""
        encoded = [self._encode(p) for p in _as_list(prompts)]
        if any(images for _, _, images in encoded):
            raise ValueError("beam_search: prompts with images are not supported")
        loras = _per_prompt_lora(lora_request, len(encoded)) or [None] * len(encoded)
        eos = self.engine.info.eos_token_ids
        tokenizer = self.get_tokenizer()
        searches = [BeamSearch(ids, params, eos, self.engine.config.max_model_len,
                               lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
                    for _, ids, _ in encoded]
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm)
        while live := [(s, lora) for s, lora in zip(searches, loras) if not s.done]:
            beams = [(beam, lora) for s, lora in live for beam in s.live]
            answers = iter(self._run([(None, beam.tokens, []) for beam, _ in beams],
                                     params.round_params(), False, None,
                                     [lora for _, lora in beams]))
            for search, _ in live:
                search.advance([_offered(next(answers)) for _ in search.live])
            bar.update(1)
        bar.close()
        outputs = []
        for search in searches:
            best = search.best()
            for beam in best:  # as vLLM's: the prompt's text and the beam's (cut at a stop)
                beam.text = (tokenizer.decode(beam.tokens) if beam.output_text is None else
                             tokenizer.decode(beam.tokens[:search.num_prompt])
                             + beam.output_text)
            outputs.append(BeamSearchOutput(best))
        return outputs

    def embed(self, prompts: PromptInput | Sequence[PromptInput], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, pooled as --pooling-type and --override-pooler-config
        say (the last token's final hidden state, L2-normalized, by default); under
        lora_request as in `generate`."""
        encoded = [self._encode(p, truncate=truncate_prompt_tokens, room=0)[1]
                   for p in _as_list(prompts)]
        loras = _per_prompt_lora(lora_request, len(encoded)) or [None] * len(encoded)
        outputs: dict[str, EmbeddingRequestOutput] = {}
        try:
            for ids, lora in zip(encoded, loras):
                rid = str(next(self._ids))
                self.engine.add_embedding(rid, ids, lora=lora)
                outputs[rid] = EmbeddingRequestOutput(rid, ids, EmbeddingOutput([]))
        except BaseException:  # an adapter refused: none of the call runs
            for rid in outputs:
                self.engine.abort(rid)
            raise
        bar = tqdm(total=len(encoded), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                out = outputs[delta.rid]
                assert delta.embedding is not None, "an embedding request answers once"
                out.outputs.embedding = np.frombuffer(delta.embedding, "<f4").tolist()
                out.finished = True
                bar.update(1)
        bar.close()
        return list(outputs.values())

    def _encode(self, prompt: PromptInput, **options: Any) -> Encoded:
        """`options` go to InputProcessor.prompt_ids (truncation, room). A dict prompt
        may carry vLLM's {"multi_modal_data": {"image": image or [images]}} (PIL images),
        one per image placeholder of the prompt, and {"video": video or [videos]} (each
        an array of frames [T, H, W, 3], or (frames, {"fps": ...})), one per video
        placeholder."""
        images: list[Any] = []
        videos: list[Any] = []
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            images, videos = _media_of(prompt.get("multi_modal_data"))
        elif isinstance(prompt, str):
            text, ids = prompt, None
        else:
            text, ids = None, list(prompt)
        processor = self.engine.processor
        ids = processor.prompt_ids(text, ids, None, **options)
        return (text, *processor.with_images(ids, images, videos))

    def _run(self, encoded: list[Encoded],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, priority: Sequence[int] | None,
             loras: Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        params_list = _per_prompt(sampling_params or self.get_default_sampling_params(),
                                  len(encoded))
        outputs: dict[str, RequestOutput] = {}
        try:
            for i, ((text, ids, images), params) in enumerate(zip(encoded, params_list)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, _generated(params),
                                        priority[i] if priority else 0,
                                        loras[i] if loras else None, images)
                outputs[rid] = RequestOutput(rid, text, ids, [
                    CompletionOutput(j) for j in range(params.num_generated)])
        except BaseException:  # a request refused (a bad grammar): none of the call runs
            for rid in outputs:
                self.engine.abort(rid)
            raise
        bar = tqdm(total=len(encoded), desc="Processed prompts", disable=not use_tqdm)
        with fewer_collections():
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    out = outputs[delta.rid]
                    was_finished = out.finished
                    _apply(out, delta)
                    if out.finished and not was_finished:
                        bar.update(1)
        bar.close()
        for out, params in zip(outputs.values(), params_list):
            if params.num_generated > params.n:
                _keep_best(out, params)
        return list(outputs.values())


def check_offline_sizes(data_parallel_size: int) -> None:
    """Refuse the sizes vLLM's LLM takes that one offline engine cannot run."""
    if data_parallel_size != 1:  # vLLM's LLM refuses it too
        raise ConfigError(f"data_parallel_size={data_parallel_size}: an LLM is one engine; "
                          "run one LLM per process, or `headrace serve "
                          "--data-parallel-size N` for N shards behind one endpoint")


def _apply(out: RequestOutput, delta: TextDelta) -> None:
    completion = out.outputs[delta.index]
    if completion.finished() or delta.seq != len(completion.token_ids):
        return  # tokens a stop string already ended
    completion.text += delta.text
    completion.token_ids += delta.token_ids
    if delta.logprobs:
        if completion.logprobs is None:
            completion.logprobs = []
        # extended in place: a new list per delta made a completion's logprobs quadratic
        completion.logprobs += [_logprob_dict(lp) for lp in delta.logprobs]
        completion.cumulative_logprob = ((completion.cumulative_logprob or 0.0)
                                         + sum(lp.logprobs[0] for lp in delta.logprobs))
    if delta.prompt_logprobs:
        out.prompt_logprobs = [None if lp is None else _logprob_dict(lp)
                               for lp in delta.prompt_logprobs]
    if delta.finish_reason is not None:
        completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason


def _generated(params: SamplingParams) -> SamplingParams:
    """What the engine runs: best_of completions, each scored by its tokens' logprobs;
    each completion's text made once, at its end (the caller sees only finished ones)."""
    final = RequestOutputKind.FINAL_ONLY
    if params.num_generated == params.n:
        return params.replace(output_kind=final)
    logprobs = 0 if params.logprobs is None else params.logprobs
    return params.replace(n=params.num_generated, best_of=None, logprobs=logprobs,
                          output_kind=final)


def _keep_best(out: RequestOutput, params: SamplingParams) -> None:
    """best_of's choice: the n completions of highest cumulative logprob, renumbered; the
    logprobs only if asked for (the cumulative logprob stays, as the score)."""
    scores = [c.cumulative_logprob or 0.0 for c in out.outputs]
    out.outputs = [out.outputs[i] for i in best_of_indices(scores, params.n)]
    for index, completion in enumerate(out.outputs):
        completion.index = index
        if params.logprobs is None:
            completion.logprobs = None


def _offered(out: RequestOutput) -> dict[int, float]:
    """A beam's round: the next tokens the engine offered and their logprobs."""
    logprobs = out.outputs[0].logprobs
    entries = logprobs[0] if logprobs else {}
    return {token: lp.logprob for token, lp in entries.items()}


def _logprob_dict(lp: TokenLogprobs) -> LogprobsDict:
    """vLLM's {token id: Logprob}: the chosen token at its rank, then the top-k at ranks 1,
    2, ... (a top token that is the chosen one keeps the chosen one's entry)."""
    ids, values = lp.token_ids, lp.logprobs
    texts = lp.texts or [None] * len(ids)
    entries: LogprobsDict = {ids[0]: Logprob(values[0], lp.rank, texts[0])}
    for rank in range(1, len(ids)):
        if ids[rank] not in entries:
            entries[ids[rank]] = Logprob(values[rank], rank, texts[rank])
    return entries


def _media_of(data: dict[str, Any] | None) -> tuple[list[Any], list[Any]]:
    """multi_modal_data's images and videos."""
    if not data:
        return [], []
    unknown = sorted(set(data) - {"image", "video"})
    if unknown:
        raise ValueError(f"multi_modal_data: only 'image' and 'video' are supported, got "
                         f"{unknown}")
    images = data.get("image", [])
    videos = data.get("video", [])
    # one video is an array of frames, a list of frames, or (frames, metadata)
    one_video = isinstance(videos, tuple) or getattr(videos, "ndim", 0) == 4 or (
        isinstance(videos, list) and videos and getattr(videos[0], "ndim", 0) == 3)
    return (list(images) if isinstance(images, (list, tuple)) else [images],
            [videos] if one_video else list(videos))


def _as_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):  # one tokenized prompt
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)


def _per_prompt(params: SamplingParams | Sequence[SamplingParams], n: int
                ) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)


def _per_prompt_lora(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
                     ) -> list[LoRARequest | None] | None:
    if lora is None or isinstance(lora, LoRARequest):
        return None if lora is None else [lora] * n
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} LoRA requests for {n} prompts")
    return list(lora)

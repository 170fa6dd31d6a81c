"""The tokenizer core: a client request in, a validated, tokenized AdmitRequest out.

It applies the chat template, tokenizes, checks lengths against max_model_len, resolves
sampling values (client over generation config over SamplingParams defaults), fills in
the EOS ids and the token ids of bad_words, and has xgrammar parse a structured-output
spec. Anything wrong with the request raises ApiError, which the shell turns into an
ErrorReply; nothing invalid reaches the scheduler. An embedding request is only tokenized: it samples nothing, so its prompt
may fill the whole context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from common.chat import chat_image_urls, chat_video_urls, render_chat
from common.errors import ApiError
from common.lora import AdapterError, read_adapter_config
from common.messages import AdmitRequest, GenerateRequest, ImageInput, LoRARequest
from common.model_info import ModelInfo
from common.sampling_defaults import SamplingDefaults
from common.sampling_params import (CLIENT_PARAMS, SamplingError, SamplingParams,
                                    check_json_type, json_kinds)
from common.structured_outputs import to_grammar
from common.tokens import check_vocabulary
from services.tokenizer.images import ImagePrompts
from common.media import MediaRules, load_images, load_videos

# What an embedding request's AdmitRequest carries: nothing is sampled, so nothing reads it.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1)


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, defaults: SamplingDefaults,
                 max_logprobs: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_lora_rank: int | None = None,
                 images: ImagePrompts | None = None,
                 media: MediaRules | None = None) -> None:
        """images: a vision-language model's image processing (None: text only); media:
        where its image URLs may come from."""
        self.tokenizer = tokenizer
        self.images = images
        self.media = media or MediaRules()
        self.max_model_len = max_model_len
        self.defaults = defaults
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_lora_rank = max_lora_rank  # None: LoRA is off
        self.adapters: set[int] = set()  # lora_int_ids whose config was read and is valid

    @classmethod
    def from_info(cls, info: ModelInfo) -> InputProcessor:
        config = info.config
        return cls(info.tokenizer, info.max_model_len, info.defaults, config.max_logprobs,
                   info.vocab_size, info.eos_token_ids,
                   config.max_lora_rank if config.enable_lora else None,
                   ImagePrompts.for_model(info.model_dir, info.hf_config, info.tokenizer),
                   MediaRules.from_config(config))

    def process(self, req: GenerateRequest) -> AdmitRequest:
        if req.embed:
            ids = self.prompt_ids(req.prompt, req.prompt_token_ids, None,
                                  add_special_tokens=req.add_special_tokens,
                                  truncate=req.truncate_prompt_tokens, room=0)
            admit = self.admit_embedding(req.rid, req.reply_to, ids, req.arrival_time,
                                         req.priority, req.lora)
            if req.lora is not None:
                self.check_adapter(req.lora)
            return admit
        check_client_params(req.params)
        ids = self.prompt_ids(req.prompt, req.prompt_token_ids, req.messages,
                              req.add_generation_prompt, req.add_special_tokens,
                              req.chat_template_kwargs, req.truncate_prompt_tokens, req.tools)
        images: list[ImageInput] = []
        if req.messages is not None:
            ids, images = self.chat_images(ids, req.messages)
        with sampling_checks():
            params = self.defaults.params_for(req.params)
        requested = req.params.get("max_tokens")
        if requested is not None:
            self._check_fits(len(ids), requested)
        admit = self._admit(req.rid, req.reply_to, ids, params, req.arrival_time,
                            req.priority, req.lora, images)
        if req.lora is not None:
            self.check_adapter(req.lora)
        return admit

    def check_adapter(self, lora: LoRARequest) -> None:
        """A 400 naming the adapter, here rather than in the worker's step. Ids are never
        reused for another path, so an adapter's config is read once."""
        if self.max_lora_rank is None:
            raise ApiError(400, f"LoRA adapter {lora.lora_name!r} asked for, but this "
                                "server runs without --enable-lora", "model")
        if lora.lora_int_id in self.adapters:
            return
        try:
            read_adapter_config(lora.lora_path, self.max_lora_rank)
        except AdapterError as e:
            raise ApiError(400, f"Model {lora.lora_name!r}: {e}", "model") from None
        self.adapters.add(lora.lora_int_id)

    def admit(self, rid: str, reply_to: str, prompt_token_ids: list[int],
              params: SamplingParams, arrival_time: float = 0.0, priority: int = 0,
              lora: LoRARequest | None = None, images: list[ImageInput] | None = None
              ) -> AdmitRequest:
        """Checks and resolves an already-built SamplingParams (the offline API path).
        images: the prompt's, as with_images made them."""
        ids = list(prompt_token_ids)
        self._check_token_ids(ids)
        if params.max_tokens is not None:
            self._check_fits(len(ids), params.max_tokens)
        with sampling_checks():
            params = params.replace(max_tokens=self.defaults.cap(params.max_tokens))
        return self._admit(rid, reply_to, ids, params, arrival_time, priority, lora,
                           images or [])

    def chat_images(self, ids: list[int], messages: list[dict[str, Any]]
                    ) -> tuple[list[int], list[ImageInput]]:
        """A chat prompt with its image_url parts' images and video_url parts' videos
        loaded and placed."""
        urls, video_urls = chat_image_urls(messages), chat_video_urls(messages)
        if not urls and not video_urls:
            return ids, []
        if self.images is None:
            raise ApiError(400, "This model takes no images (it is not a vision-language "
                                "model).", "messages")
        if video_urls and self.images.video_token_id is None:
            raise ApiError(400, "This model takes no videos.", "messages")
        return self.with_images(ids, load_images(urls, self.media),
                                load_videos(video_urls, self.media))

    def with_images(self, ids: list[int], images: list[Any], videos: list[Any] = ()
                    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its image and video placeholders expanded, and its images and
        videos processed (services/tokenizer/images.py)."""
        if self.images is None:
            if images or videos:
                raise ApiError(400, "This model takes no images (it is not a "
                                    "vision-language model).", "messages")
            return ids, []
        ids, inputs = self.images.expand(ids, images, videos)
        self._check_token_ids(ids)
        return ids, inputs

    def admit_embedding(self, rid: str, reply_to: str, prompt_token_ids: list[int],
                        arrival_time: float = 0.0, priority: int = 0,
                        lora: LoRARequest | None = None) -> AdmitRequest:
        """An embedding request of checked ids (as `admit`, for the offline API too),
        pooled from the model under `lora` (None: the base model)."""
        ids = list(prompt_token_ids)
        self._check_token_ids(ids, room=0)
        return AdmitRequest(rid=rid, reply_to=reply_to, prompt_token_ids=ids,
                            params=EMBEDDING_PARAMS, arrival_time=arrival_time,
                            priority=priority, embed=True, lora=lora)

    def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None,
                   messages: list[dict] | None, add_generation_prompt: bool = True,
                   add_special_tokens: bool | None = None,
                   template_kwargs: dict[str, Any] | None = None,
                   truncate: int | None = None,
                   tools: list[dict[str, Any]] | None = None, room: int = 1) -> list[int]:
        """The prompt's token ids. `add_special_tokens` (BOS and the like) defaults to
        True for a text prompt and False for a chat, whose template writes its own;
        `truncate` is vLLM's truncate_prompt_tokens; `room` the tokens the context must
        keep free past the prompt (0 for an embedding, which generates nothing)."""
        given = [name for name, value in (("prompt", prompt),
                                          ("prompt_token_ids", prompt_token_ids),
                                          ("messages", messages)) if value is not None]
        if len(given) != 1:
            raise ApiError(400, "Give exactly one of prompt, prompt_token_ids and messages; "
                                f"got {', '.join(given) or 'none'}.",
                           given[-1] if given else "prompt")
        if messages is not None:
            text = render_chat(self.tokenizer, messages, add_generation_prompt,
                               template_kwargs, tools)
            ids = self._text_ids(text, bool(add_special_tokens))
        elif prompt is not None:
            ids = self._text_ids(prompt, add_special_tokens is not False)
        else:
            ids = list(prompt_token_ids or [])
        ids = self._truncated(ids, truncate, room)
        self._check_token_ids(ids, room)
        return ids

    # --- prompts ----------------------------------------------------------------------

    def _text_ids(self, prompt: str, add_special_tokens: bool) -> list[int]:
        if not isinstance(prompt, str):
            raise ApiError(400, f"prompt must be a string, got {type(prompt).__name__}",
                           "prompt")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def _truncated(self, ids: list[int], keep: int | None, room: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last `keep` tokens; -1 keeps what fits."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.max_model_len - room
        if keep < 1:
            raise ApiError(400, f"truncate_prompt_tokens must be -1 or at least 1, got "
                                f"{keep}", "truncate_prompt_tokens")
        return ids[-keep:]

    def _check_token_ids(self, ids: list[int], room: int = 1) -> None:
        if not ids:
            raise ApiError(400, "The prompt cannot be empty.", "prompt")
        check_vocabulary(ids, self.vocab_size, "prompt_token_ids")
        if room == 0 and len(ids) > self.max_model_len:  # vLLM's words for an embedding
            raise ApiError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {len(ids)} tokens in the input for embedding "
                "generation. Please reduce the length of the input.", "input")
        if room and len(ids) >= self.max_model_len:  # not one token of room left to generate
            raise ApiError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {len(ids)} input tokens, which leaves no room "
                "for output tokens. Please reduce the length of the input.", "prompt")

    # --- sampling ---------------------------------------------------------------------

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt + max_tokens > self.max_model_len:
            raise ApiError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in "
                f"the input, {max_tokens} in max_tokens). Please reduce the length of the "
                "input or max_tokens.", "max_tokens")

    def _check_sampling_ids(self, params: SamplingParams) -> None:
        """vLLM refuses ids past the vocabulary in logit_bias and allowed_token_ids."""
        if params.logit_bias:
            check_vocabulary(list(params.logit_bias), self.vocab_size, "logit_bias")
        if params.allowed_token_ids:
            check_vocabulary(params.allowed_token_ids, self.vocab_size, "allowed_token_ids")

    def _bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        out = bad_words_token_ids(self.tokenizer, words)
        for ids in out:
            check_vocabulary(ids, self.vocab_size, "bad_words")
        return out

    def _admit(self, rid: str, reply_to: str, ids: list[int], params: SamplingParams,
               arrival_time: float, priority: int, lora: LoRARequest | None = None,
               images: list[ImageInput] | None = None) -> AdmitRequest:
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        with sampling_checks():
            params = params.replace(max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                                    bad_words_token_ids=self._bad_words_ids(params.bad_words))
            params.check_logprobs(self.max_logprobs)
            if params.structured_outputs is not None:
                to_grammar(params.structured_outputs)  # a bad one stops here, not in a worker
        self._check_sampling_ids(params)
        return AdmitRequest(rid=rid, reply_to=reply_to, prompt_token_ids=ids, params=params,
                            arrival_time=arrival_time, priority=priority, lora=lora,
                            images=images or [])


def bad_words_token_ids(tokenizer: Any, words: tuple[str, ...]
                        ) -> tuple[tuple[int, ...], ...]:
    """Each word's ids as the word opens a text, and, where that is another token at the
    word's start but as many tokens (a tokenizer that spells a leading space into the
    token), as it follows another word: vLLM's two spellings of a bad word."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [ids for ids in (bare,) if ids]
        if bare and spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


@contextmanager
def sampling_checks() -> Iterator[None]:
    try:
        yield
    except SamplingError as e:
        raise ApiError(400, str(e), e.param) from None


def check_client_params(params: dict[str, Any]) -> None:
    """Names and JSON types of the client's sampling values; ranges are SamplingParams'."""
    for name, value in params.items():
        if name not in CLIENT_PARAMS:
            raise ApiError(400, f"Unknown sampling parameter {name!r}.", name)
        with sampling_checks():
            check_json_type(name, value, json_kinds(name))

"""Every message that crosses a stream, and the one MessagePack codec for them.

Reading this module tells the whole protocol:

    gateway ──GenerateRequest──> tokenizer ──AdmitRequest──> scheduler ──StepPlan──> worker
    gateway <──ReplyBatch── detokenizer <──TokenBatch── scheduler <──StepResult/WorkerReady──┘
    gateway, detokenizer ──Abort──> scheduler;  any stage ──ErrorReply──> gateway

Records are frozen dataclasses (`record`). Fields are only ever appended (with defaults),
so an older reader ignores what it does not know and a newer reader fills in what an older
writer did not send. Token ids and floats travel as packed little-endian int32 / float32
bytes, the timestamps of the hops a message passed (common/hops.py) as float64. An
embedding travels as the bytes of its little-endian float32 vector, from the worker to the
gateway.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import struct
import sys
import types
import typing
from array import array
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, ClassVar

import msgpack
import numpy as np

from common.sampling_params import SamplingParams


class MessageError(ValueError):
    """Bytes that are not a valid message: malformed, truncated, unknown tag, bad field."""


class _Packed:
    def __init__(self, dtype: str) -> None:
        self.dtype = np.dtype(dtype)


Tokens = Annotated[list[int], _Packed("<i4")]
Floats = Annotated[list[float], _Packed("<f4")]
Times = Annotated[list[float], _Packed("<f8")]  # wall-clock stamps, see common/hops.py

_REGISTRY: dict[str, type] = {}
_FACTORY = object()  # a defaulted-by-factory argument left out


def record(cls: type) -> type:
    """A frozen dataclass with slots whose __init__ sets the slots directly, as the codec
    builds decoded records: dataclasses' own __init__ goes through object.__setattr__ for
    each field, which takes twice as long, and the scheduler and the offline engine build
    a few records a token."""
    assert not hasattr(cls, "__post_init__"), f"{cls.__name__}: this __init__ would skip it"
    cls = dataclass(frozen=True, slots=True)(cls)
    env: dict[str, Any] = {"FACTORY": _FACTORY}
    params, lines = [], []
    for i, f in enumerate(dataclasses.fields(cls)):
        assert f.init and not f.kw_only and f.name != "self", f"{cls.__name__}.{f.name}"
        env[f"set{i}"] = getattr(cls, f.name).__set__
        value = f.name
        if f.default is not dataclasses.MISSING:
            env[f"default{i}"] = f.default
            params.append(f"{f.name}=default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"factory{i}"] = f.default_factory
            params.append(f"{f.name}=FACTORY")
            value = f"factory{i}() if {f.name} is FACTORY else {f.name}"
        else:
            params.append(f.name)
        lines.append(f"    set{i}(self, {value})")
    # the source is built from the class's field names only
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(lines or ["    pass"]),
         env)
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls


def message(tag: str, version: int = 1) -> Callable[[type], type]:
    """Register a top-level message class under its wire tag."""
    def register(cls: type) -> type:
        assert tag not in _REGISTRY, f"duplicate message tag {tag}"
        cls.TYPE, cls.VERSION = tag, version
        _REGISTRY[tag] = cls
        return cls
    return register


# --- records nested inside messages ------------------------------------------------------

@record
class TokenLogprobs:
    """Logprobs at one position: entry 0 is the chosen token, then the top-k."""
    token_ids: Tokens
    logprobs: Floats
    rank: int  # rank of the chosen token in the distribution, 1 = most likely
    texts: list[str] = field(default_factory=list)  # filled in by the detokenizer


@record
class PromptLogprobs:
    """Prompt logprobs of one request for positions [start, start + rows)."""
    req_id: str
    start: int
    num_logprobs: int  # k: each row holds k + 1 entries
    token_ids: Tokens  # rows * (k + 1), row-major
    logprobs: Floats
    ranks: Tokens  # one per row

    def rows(self) -> list[TokenLogprobs]:
        width = self.num_logprobs + 1
        return [TokenLogprobs(self.token_ids[i * width:(i + 1) * width],
                              self.logprobs[i * width:(i + 1) * width], self.ranks[i])
                for i in range(len(self.ranks))]


@record
class StepLogprobs:
    """The sampled tokens' logprobs of one step, end to end: the step's row i (of its
    req_ids) has widths[i] entries, the chosen token then its top-k, or none (0). The
    worker fills these columns straight from its one copy of the step's output, and they
    travel as four packed arrays: a record a row cost the worker, the wire and the
    scheduler about 5 us a row (issue 31), and rows() makes them once, where they are
    taken apart."""
    widths: Tokens
    token_ids: Tokens
    logprobs: Floats
    ranks: Tokens  # one per row with entries
    # each token id's text, or none: the offline engine adds them as steps come in
    texts: list[str] = field(default_factory=list)

    def rows(self) -> list[TokenLogprobs | None]:
        self._check()
        widths, ids, values, ranks = self.widths, self.token_ids, self.logprobs, self.ranks
        texts = self.texts
        out: list[TokenLogprobs | None] = []
        at = taken = 0
        for width in widths:
            if not width:
                out.append(None)
                continue
            end = at + width
            out.append(TokenLogprobs(ids[at:end], values[at:end], ranks[taken],
                                     texts[at:end]))
            at, taken = end, taken + 1
        return out

    def select(self, rows: list[int]) -> StepLogprobs:
        """The columns of these rows, in this order, -1 for a row without entries: the
        served scheduler sends a TokenBatch's logprobs so, its row i items[i]'s."""
        if rows == list(range(len(self.widths))):
            return self
        self._check()
        widths, ids, values, texts = self.widths, self.token_ids, self.logprobs, self.texts
        starts = list(itertools.accumulate(widths, initial=0))
        rank_of = list(itertools.accumulate((w > 0 for w in widths), initial=0))
        out_widths: list[int] = []
        out_ids: list[int] = []
        out_values: list[float] = []
        out_ranks: list[int] = []
        out_texts: list[str] = []
        for row in rows:
            width = widths[row] if row >= 0 else 0
            out_widths.append(width)
            if width:
                at = starts[row]
                out_ids += ids[at:at + width]
                out_values += values[at:at + width]
                out_ranks.append(self.ranks[rank_of[row]])
                out_texts += texts[at:at + width]
        return StepLogprobs(out_widths, out_ids, out_values, out_ranks, out_texts)

    def _check(self) -> None:
        widths, ids, texts = self.widths, self.token_ids, self.texts
        if (min(widths, default=0) < 0 or sum(widths) != len(ids)
                or len(self.logprobs) != len(ids)
                or len(widths) - widths.count(0) != len(self.ranks)
                or len(texts) not in (0, len(ids))):
            raise MessageError(f"step logprobs of widths {widths} do not match their "
                               f"{len(ids)} ids, {len(self.logprobs)} values, "
                               f"{len(self.ranks)} ranks and {len(texts)} texts")


@record
class LoRARequest:
    """A LoRA adapter to generate under, as vLLM's: a PEFT directory, named for clients,
    with an id unique to its path (the worker's slots and the prefix cache key on it)."""
    lora_name: str
    lora_int_id: int
    lora_path: str


@record
class ImageInput:
    """One image of a prompt, as the tokenizer stage processed it: its placeholder tokens
    are prompt_token_ids[offset:offset + length], and its patches (the model's image
    processor's pixel_values rows) are float32 [t * h * w, patch_dim]. The patches travel
    inline (`pixels`) or, when large, as a Redis key of their own (`key`) that the worker
    reads. `hash` names the image's content: the worker's encoder cache and the prefix
    cache key on it. A video is one too: its frames in pairs (temporal patches), t > 1."""
    hash: str
    offset: int
    length: int
    grid_thw: Tokens  # patches in time, height and width, before merging
    pixels: bytes = b""  # little-endian float32, row-major
    key: str = ""  # where the pixels are when they are not inline
    # a video's seconds per temporal patch (Qwen2.5-VL spaces its time positions by it);
    # 0.0 for an image
    second_per_grid_t: float = 0.0
    # the image's tokens attend to each other both ways in the prefill (Gemma 3), so the
    # scheduler computes them in one step and the attention lets each see the last
    bidirectional: bool = False


@record
class NewRequest:
    """A request the worker has not seen (or sees again after preemption)."""
    req_id: str
    token_ids: Tokens  # every known token: prompt, then outputs when resumed
    num_prompt_tokens: int
    block_ids: Tokens
    params: SamplingParams
    embed: bool = False  # an embedding request: pool its prompt, sample nothing
    lora: LoRARequest | None = None  # its adapter; the worker loads it on first use
    images: list[ImageInput] = field(default_factory=list)  # in prompt order


@record
class PooledOutput:
    """The embedding of one request whose prompt a step finished computing."""
    req_id: str
    data: bytes  # little-endian float32, hidden_size of them


@record
class CachedRequest:
    """A running request that got more blocks this step."""
    req_id: str
    new_block_ids: Tokens


@record
class DetokParams:
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@record
class DetokItem:
    """New tokens of one completion, with the context any detokenizer replica needs."""
    rid: str
    index: int
    reply_to: str
    seq: int  # number of output tokens before new_token_ids
    new_token_ids: Tokens
    context_ids: Tokens  # the tokens just before new_token_ids (prompt tail, then outputs)
    num_context_prompt: int  # how many of context_ids are prompt tokens
    params: DetokParams
    num_prompt_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    request_stamps: Times = field(default_factory=list)  # the request's way in; seq 0 only
    num_cached_tokens: int = 0  # prompt tokens the prefix cache had; seq 0 only
    embedding: bytes | None = None  # an embedding request's answer (PooledOutput.data)


@record
class TextDelta:
    """What the gateway appends to one completion; `seq` orders and de-duplicates."""
    rid: str
    index: int
    seq: int
    text: str
    token_ids: Tokens
    num_prompt_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    request_stamps: Times = field(default_factory=list)  # the request's way in; seq 0 only
    num_cached_tokens: int = 0  # prompt tokens the prefix cache had; seq 0 only
    embedding: bytes | None = None  # an embedding request's answer (PooledOutput.data)


# --- messages ------------------------------------------------------------------------------

@message("generate")
@record
class GenerateRequest:
    """gateway -> tokenizer (hr:requests). `params` holds only what the client set; the
    tokenizer fills the rest from the model's generation config."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    rid: str
    reply_to: str
    params: dict[str, Any]
    prompt: str | None = None
    prompt_token_ids: Tokens | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    priority: int = 0
    arrival_time: float = 0.0
    add_special_tokens: bool | None = None  # None: True for a prompt, False for a chat
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: fit
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. enable_thinking
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool definitions, for the template
    embed: bool = False  # /v1/embeddings: the prompt's embedding, no completion
    lora: LoRARequest | None = None  # the adapter the request's model names


@message("admit")
@record
class AdmitRequest:
    """tokenizer -> scheduler (hr:admit): a validated, tokenized request."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    rid: str
    reply_to: str
    prompt_token_ids: Tokens
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    stamps: Times = field(default_factory=list)  # arrival, tokenizer in, tokenizer out
    embed: bool = False  # an embedding request: its params are never read
    lora: LoRARequest | None = None  # generate under this adapter, None: the base model
    images: list[ImageInput] = field(default_factory=list)  # in prompt order


@message("abort")
@record
class Abort:
    """gateway (client gone) or detokenizer (stop string) -> scheduler (hr:control)."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    rid: str
    index: int | None = None  # None: every completion of the request
    reason: str = "abort"  # "abort" or "stop"
    stop_reason: str | None = None


@message("routed")
@record
class Routed:
    """tokenizer -> gateway (hr:replies:<gateway>): the shard a request went to, so that
    the gateway sends its abort there and ends it if that shard stops."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    rid: str
    shard: int


@message("error")
@record
class ErrorReply:
    """any stage -> gateway (hr:replies:<gateway>): the request ends with this error."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    rid: str
    status: int
    message: str
    kind: str = "BadRequestError"
    param: str | None = None


@message("plan")
@record
class StepPlan:
    """scheduler -> worker (hr:steps): what one engine step computes."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    step: int
    req_ids: list[str]  # batch order
    num_scheduled_tokens: Tokens
    num_computed_tokens: Tokens  # position of each request's first scheduled token
    new: list[NewRequest] = field(default_factory=list)
    cached: list[CachedRequest] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # drop these before the step
    epoch: str = ""  # the worker this plan is for; a restarted worker skips older plans
    scheduler_epoch: str = ""  # a new value means a restarted scheduler: drop all state
    planned_at: float = 0.0
    # ngram drafts (speculative decoding): per request of req_ids, how many of its scheduled
    # tokens are drafts after its last token, and those drafts, flattened; empty: none
    num_draft_tokens: Tokens = field(default_factory=list)
    draft_token_ids: Tokens = field(default_factory=list)


@message("drain")
@record
class DrainSteps:
    """scheduler -> worker (hr:steps): no plan follows until some of the steps sent come
    back. A worker of pipeline stages holds its newest steps' results until later plans
    push them out (services/worker/layers/pipeline.py); this tells it to hand them back."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    epoch: str = ""  # the worker it is for, as a plan's
    scheduler_epoch: str = ""


@message("result", version=2)  # 2: logprobs as StepLogprobs columns
@record
class StepResult:
    """worker -> scheduler (hr:results): the tokens one step sampled."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    step: int
    req_ids: list[str]  # the requests that sampled, batch order
    token_ids: Tokens
    logprobs: StepLogprobs | None = None  # of the rows that asked for them
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    epoch: str = ""
    # the device's time on this step, and on earlier ones whose end no one waited for
    # (services/worker/device_time.py); 0 off a GPU and on pipeline stages
    device_ms: float = 0.0
    stamps: Times = field(default_factory=list)  # planned, started, tokens on the host
    embeddings: list[PooledOutput] = field(default_factory=list)  # of embedding requests
    # tokens per request of req_ids (token_ids is then their concatenation): 1 + accepted
    # drafts for a speculating request; empty when every request sampled one token
    num_tokens: Tokens = field(default_factory=list)
    # a draft model's greedy proposals after each request's last token, for its next step
    # (draft_token_ids is their concatenation): a count per request of req_ids, 0 for one
    # that may not speculate; both empty without a draft model
    num_draft_tokens: Tokens = field(default_factory=list)
    draft_token_ids: Tokens = field(default_factory=list)


@message("worker_ready")
@record
class WorkerReady:
    """worker -> scheduler (hr:results): the worker (re)started with a fresh KV cache."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    worker_id: str
    epoch: str
    num_blocks: int
    block_size: int
    max_model_len: int
    pipeline_stages: int = 1  # the scheduler plans for these, whatever its own flag says


@message("worker_failed")
@record
class WorkerFailed:
    """worker -> gateways (stored at the shard's worker:failed key): the worker could not
    load the model, `failures` times in a row, the last for `reason`; a worker that starts
    deletes it."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    worker_id: str
    model: str
    reason: str  # the exception's one line
    failures: int


@message("request_failed")
@record
class RequestFailed:
    """worker -> scheduler (hr:results): requests the worker could not run (an image whose
    pixels lapsed from Redis); it left them out of their step, and the scheduler ends each
    with `status` and `message`. The rest of the batch runs on."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    req_ids: list[str]
    message: str
    epoch: str = ""
    status: int = 503


@record
class DetokExtras:
    """What a TokenBatch row carries besides its new tokens, on the few rows that do: a
    completion's first (what the request brought in), its last (why it ended), a held
    FINAL_ONLY output's logprobs, an embedding's answer."""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    request_stamps: Times = field(default_factory=list)
    num_cached_tokens: int = 0
    embedding: bytes | None = None


@message("tokens", version=3)  # 3: a column a field, not a record an item
@record
class TokenBatch:
    """scheduler -> detokenizers (hr:detok): one step's new tokens, every request, a row
    each, as columns (common/token_columns.py writes and reads them). A DetokItem a row
    cost the scheduler a record, a map and two packed arrays on the wire each, most of its
    time at 256 streams (issue 31); a row's DetokItem is made again where it is
    detokenized, on a replica that scales out."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    step: int
    rids: list[str]
    indexes: Tokens
    reply_to: list[str]
    seqs: Tokens
    new_ends: Tokens  # row i's new tokens are new_token_ids[new_ends[i-1]:new_ends[i]]
    new_token_ids: Tokens
    context_ends: Tokens  # and its context, context_ids[context_ends[i-1]:context_ends[i]]
    context_ids: Tokens
    num_context_prompt: Tokens
    num_prompt_tokens: Tokens
    params: list[DetokParams]  # the distinct ones; row i has params[params_of[i]]
    params_of: Tokens
    extras: dict[int, DetokExtras] = field(default_factory=dict)  # by row
    stamps: Times = field(default_factory=list)  # the step's, from its StepResult
    shard: int = 0  # whose scheduler: a stop string's abort goes back to it
    # Row i: its new token's logprobs, where its extras carry none. The step's columns go
    # on as the worker sent them: a TokenLogprobs record a row cost the scheduler a record
    # and a map on the wire each (issue 31).
    logprobs: StepLogprobs | None = None


@message("replies")
@record
class ReplyBatch:
    """detokenizer -> one gateway (hr:replies:<gateway>): text for its requests."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    items: list[TextDelta]
    stamps: Times = field(default_factory=list)  # the step's, then detokenizer in and out


@message("sched_stats")
@record
class SchedulerStats:
    """scheduler -> gateways (a key, read at /metrics scrape time)."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    ts: float = 0.0
    waiting_tokens: int = 0  # prompt tokens of the waiting requests not yet computed
    device_busy_seconds: float = 0.0  # StepResult.device_ms, summed
    # speculative decoding, vLLM v1's counters (services/scheduler/core.py SpecDecodingStats)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@message("response")
@record
class StoredResponse:
    """gateway -> gateways (a key with a TTL): a /v1/responses answer, so that any replica
    can retrieve it or continue from it (previous_response_id). `messages` is the
    conversation up to and including the answer, as chat messages, without instructions
    (OpenAI does not carry a response's instructions over to the next)."""
    TYPE: ClassVar[str]
    VERSION: ClassVar[int]
    response: str  # the response object's JSON, as it was answered
    messages: list[dict[str, Any]]


Message = (GenerateRequest | AdmitRequest | Abort | Routed | ErrorReply | StepPlan
           | StepResult | WorkerReady | TokenBatch | ReplyBatch | SchedulerStats)


def plain_fields(msg: Any) -> dict[str, str]:
    """The readable fields stored beside the body: `type`, and `rid` or a count `n`."""
    out = {"type": msg.TYPE}
    if hasattr(msg, "rid"):
        out["rid"] = msg.rid
    else:
        for name in ("req_ids", "items", "rids"):
            if hasattr(msg, name):
                out["n"] = str(len(getattr(msg, name)))
        if hasattr(msg, "step"):
            out["step"] = str(msg.step)
    return out


# --- codec ---------------------------------------------------------------------------------

Converter = Callable[[Any], Any]


def encode(msg: Any) -> bytes:
    cls = type(msg)
    if _REGISTRY.get(getattr(cls, "TYPE", None)) is not cls:
        raise MessageError(f"{cls.__name__} is not a registered message")
    try:
        body = _codec(cls)[0](msg)
        body["t"], body["v"] = cls.TYPE, cls.VERSION
        return msgpack.packb(body, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as e:
        raise MessageError(f"cannot encode {cls.TYPE}: {e}") from None


def decode(data: bytes) -> Any:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad bytes
        raise MessageError(f"not MessagePack: {e}") from None
    if not isinstance(body, dict):
        raise MessageError(f"a message is a map, got {type(body).__name__}")
    tag = body.get("t")
    cls = _REGISTRY.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {body.get('t')!r}")
    try:
        return _codec(cls)[1](body)
    except MessageError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise MessageError(f"bad {cls.TYPE} message: {e}") from None


def requester(data: bytes) -> tuple[str, str] | None:
    """(rid, reply_to) of a request whose body did not decode as its type, when its map
    still names both as strings: whoever gives up on it can still answer the client."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on bad bytes
        return None
    if not isinstance(body, dict):
        return None
    rid, reply_to = body.get("rid"), body.get("reply_to")
    if isinstance(rid, str) and isinstance(reply_to, str) and rid and reply_to:
        return rid, reply_to
    return None


_CODECS: dict[Any, tuple[Converter, Converter]] = {}


def _codec(hint: Any) -> tuple[Converter, Converter]:
    """(to_wire, from_wire) for a type hint, built once and cached."""
    key = hint
    if key not in _CODECS:
        _CODECS[key] = _build_codec(hint)
    return _CODECS[key]


def _build_codec(hint: Any) -> tuple[Converter, Converter]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return _packed_codec(args[1].dtype)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            to, frm = _codec(inner[0])
            return (lambda v: None if v is None else to(v),
                    lambda w: None if w is None else frm(w))
        return _scalar_codec(args)
    if origin in (list, tuple):
        if args[0] in _EXACT:
            return _scalar_list_codec(args[0])
        to, frm = _codec(args[0])
        return (lambda v: [to(x) for x in v], lambda w: [frm(x) for x in _typed(w, list)])
    if origin is dict and args[0] is int:  # as pairs: decode takes only string map keys
        key, (to, frm) = _codec(int)[1], _codec(args[1])
        return (lambda v: [[k, to(x)] for k, x in v.items()],
                lambda w: {key(k): frm(x) for k, x in _typed(w, list)})
    if origin is dict or hint is dict:
        return (lambda v: dict(v), lambda w: _typed(w, dict))
    if dataclasses.is_dataclass(hint):
        return _record_codec(hint)
    if hint is Any:
        return (lambda v: v, lambda w: w)
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return _enum_codec(hint)
    return _scalar_codec((_scalar_type(hint),))


def _scalar_list_codec(kind: type) -> tuple[Converter, Converter]:
    """A list of str, int, float or bool: no call an element on either side when every
    element is of the exact type (a step's request ids, a batch's rids), the scalar
    codec's checks for one that is not."""
    frm = _codec(kind)[1]

    def from_wire(w: Any) -> list:
        if type(w) is not list:
            w = _typed(w, list)
        if all(type(x) is kind for x in w):
            return w
        return [frm(x) for x in w]
    return list, from_wire


def _enum_codec(kind: type[enum.IntEnum]) -> tuple[Converter, Converter]:
    """An IntEnum travels as its integer; one the reader does not know is refused."""
    def from_wire(w: Any) -> enum.IntEnum:
        if type(w) is not int:
            raise MessageError(f"{kind.__name__} is an integer, got {type(w).__name__}")
        try:
            return kind(w)
        except ValueError:
            raise MessageError(f"{w} is no {kind.__name__}") from None
    return int, from_wire


def _record_codec(cls: type) -> tuple[Converter, Converter]:
    """Encode and decode functions written for `cls`, as dataclasses writes `__init__`.

    Steps carry hundreds of records, and a loop over (name, converter) pairs per record was
    40% of a gateway's time at 1000 streams (py-spy, issue 11). The written functions keep
    every check of that loop: each field's type, required fields present, packed arrays
    whole. A field at its empty default (None, an empty list, the integer 0) stays off the
    wire; the reader fills it back in."""
    hints = typing.get_type_hints(cls, include_extras=True)
    env: dict[str, Any] = {"cls": cls, "ABSENT": _ABSENT, "MessageError": MessageError}
    put: list[str] = []
    take: list[str] = []
    args: list[str] = []
    for i, f in enumerate(dataclasses.fields(cls)):
        assert f.init and not f.kw_only, f"{cls.__name__}.{f.name} must be positional"
        to, frm = _codec(hints[f.name])
        env[f"to{i}"], env[f"frm{i}"] = to, frm
        args.append(f"v{i}")
        value = f"o.{f.name}" if to is _plain else f"to{i}(o.{f.name})"
        exact = _EXACT.get(hints[f.name])
        check = (f"if type(v{i}) is not {exact}: v{i} = frm{i}(v{i})" if exact
                 else f"v{i} = frm{i}(v{i})")
        take.append(f"    v{i} = w.get({f.name!r}, ABSENT)")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            put.append(f"    w[{f.name!r}] = {value}")
            take += [f"    if v{i} is ABSENT: raise MessageError("
                     f"\"{cls.__name__} lacks field {f.name!r}\")", f"    {check}"]
            continue
        if f.default_factory is dataclasses.MISSING:
            env[f"default{i}"], fill = f.default, f"default{i}"
        else:
            env[f"default{i}"], fill = f.default_factory, f"default{i}()"
        empty = (f"len(o.{f.name})" if f.default_factory is list
                 else f"o.{f.name} is not None" if f.default is None
                 else f"o.{f.name} != 0" if type(f.default) is int and f.default == 0
                 else None)
        put.append(f"    if {empty}: w[{f.name!r}] = {value}" if empty
                   else f"    w[{f.name!r}] = {value}")
        take += [f"    if v{i} is ABSENT: v{i} = {fill}", "    else:", f"        {check}"]
    source = "\n".join([
        "def to_wire(o):", "    w = {}", *put, "    return w",
        "def from_wire(w):",
        f"    if type(w) is not dict: raise MessageError(\"{cls.__name__} is a map, got \""
        " + type(w).__name__)",
        *take, *_construction(cls, args, env)])
    exec(source, env)  # the source is built above from the class's field names only
    return env["to_wire"], env["from_wire"]


def _construction(cls: type, args: list[str], env: dict[str, Any]) -> list[str]:
    """Lines that build `cls` from `args`. Without a __post_init__ to run, the slots are
    set directly: a frozen dataclass's __init__ costs twice that per record."""
    if hasattr(cls, "__post_init__") or not hasattr(cls, "__slots__"):
        return [f"    return cls({', '.join(args)})"]
    env["new"] = object.__new__
    lines = ["    o = new(cls)"]
    for i, (f, arg) in enumerate(zip(dataclasses.fields(cls), args)):
        env[f"set{i}"] = getattr(cls, f.name).__set__
        lines.append(f"    set{i}(o, {arg})")
    return lines + ["    return o"]


def with_fields(record: Any, **changes: Any) -> Any:
    """A copy of `record` with `changes`, as dataclasses.replace makes it, built as the
    codec builds records (slots set directly): replace's walk over the fields costs a few
    times more, and the offline engine copies a record per token with logprobs."""
    copy = _COPIERS.get(type(record))
    if copy is None:
        copy = _COPIERS[type(record)] = _copier(type(record))
    return copy(record, changes)


_COPIERS: dict[type, Callable[[Any, dict[str, Any]], Any]] = {}


def _copier(cls: type) -> Callable[[Any, dict[str, Any]], Any]:
    """copy(record, changes) for `cls`; `changes` is with_fields' own keyword dict, so its
    fields are popped from it, and whatever is left names no field."""
    names = [f.name for f in dataclasses.fields(cls)]
    env: dict[str, Any] = {"cls": cls}
    source = "\n".join([
        "def copy(o, ch):",
        *(f"    v{i} = ch.pop({name!r}) if {name!r} in ch else o.{name}"
          for i, name in enumerate(names)),
        "    if ch: raise TypeError(f'{cls.__name__} has no field {next(iter(ch))!r}')",
        *_construction(cls, [f"v{i}" for i in range(len(names))], env)])
    exec(source, env)  # the source is built above from the class's field names only
    return env["copy"]


_ABSENT = object()  # a field the wire did not carry
# Scalar fields whose exact type passes the check without a call (ints stand in for floats,
# and bools are refused for ints, in the scalar codec's slower path).
_EXACT = {str: "str", int: "int", float: "float", bool: "bool"}


def _packed_codec(dtype: np.dtype) -> tuple[Converter, Converter]:
    # array.array packs and unpacks a short list several times faster than numpy, and most
    # packed fields hold a token or two; numpy takes arrays and tensors' numpy views.
    # struct packs a long list of ints or doubles in half array's time (a TokenBatch's
    # 4,096 context ids: 31 against 65 us); float32 stays with array, which turns a value
    # past float32's range into inf where struct refuses it.
    code = {"<i4": "i", "<f4": "f", "<f8": "d"}[dtype.str]
    assert array(code).itemsize == dtype.itemsize, f"array {code!r} is not {dtype}"
    by_struct = code != "f"

    def to_wire(v: Any) -> bytes:
        if type(v) is not list or _BIG_ENDIAN:
            return np.asarray(v, dtype=dtype).tobytes()
        if len(v) < STRUCT_MIN_ITEMS or not by_struct:
            return array(code, v).tobytes()
        try:
            return struct.pack(f"<{len(v)}{code}", *v)
        except struct.error as e:  # an int out of int32's range, or no int
            raise ValueError(f"cannot pack a {dtype} array: {e}") from None

    def from_wire(w: Any) -> list:
        if type(w) is not bytes:
            w = _typed(w, bytes)
        if len(w) % dtype.itemsize:
            raise MessageError(f"packed array of {len(w)} bytes is not a whole number of "
                               f"{dtype} items")
        if _BIG_ENDIAN:
            return np.frombuffer(w, dtype=dtype).tolist()
        return array(code, w).tolist()
    return to_wire, from_wire


_BIG_ENDIAN = sys.byteorder == "big"  # array.array packs in the host's order
STRUCT_MIN_ITEMS = 16  # from here struct packs faster than array (same figures)


def _scalar_type(hint: Any) -> type:
    return {type(None): type(None)}.get(hint, hint)


def _scalar_codec(kinds: tuple[type, ...]) -> tuple[Converter, Converter]:
    accepted = tuple(float if k is float else k for k in kinds)
    if float in accepted:
        accepted += (int,)  # MessagePack may carry 1.0 as 1

    def from_wire(w: Any) -> Any:
        if isinstance(w, bool) and bool not in kinds:
            raise MessageError(f"expected {kinds}, got a bool")
        return _typed(w, accepted)
    return _plain, from_wire


def _plain(value: Any) -> Any:
    """A scalar goes on the wire as it is."""
    return value


def _typed(value: Any, kinds: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kinds):
        raise MessageError(f"expected {kinds}, got {type(value).__name__}")
    return value

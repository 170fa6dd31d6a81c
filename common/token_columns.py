"""A TokenBatch's columns: written a row at a time where a step's tokens are applied (the
served scheduler, the offline engine's pipe to its detokenizer process), read back as
DetokItems where they are detokenized. The row is the DetokItem's fields in their order,
so either end can hold items instead."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from common.messages import (DetokExtras, DetokItem, DetokParams, MessageError,
                             StepLogprobs, TokenBatch, TokenLogprobs)

# A row: DetokItem's fields, in their order (DetokItem(*fields), TokenColumns.append(*fields))
ItemFields = tuple[Any, ...]


class TokenColumns:
    """One step's rows, appended as DetokItem's fields; `batch` makes the message."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.indexes: list[int] = []
        self.reply_to: list[str] = []
        self.seqs: list[int] = []
        self.new_ends: list[int] = []
        self.new_token_ids: list[int] = []
        self.context_ends: list[int] = []
        self.context_ids: list[int] = []
        self.num_context_prompt: list[int] = []
        self.num_prompt_tokens: list[int] = []
        self.params: list[DetokParams] = []
        self.params_of: list[int] = []
        self.extras: dict[int, DetokExtras] = {}
        # by identity: requests of equal params share one object (common/detok_window.py)
        self._params_at: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.rids)

    def append(self, rid: str, index: int, reply_to: str, seq: int,
               new_token_ids: Sequence[int], context_ids: Sequence[int],
               num_context_prompt: int, params: DetokParams, num_prompt_tokens: int,
               finish_reason: str | None = None, stop_reason: str | int | None = None,
               logprobs: Sequence[TokenLogprobs] = (),
               prompt_logprobs: Sequence[TokenLogprobs | None] = (),
               request_stamps: Sequence[float] = (), num_cached_tokens: int = 0,
               embedding: bytes | None = None) -> None:
        row = len(self.rids)
        self._append_row(rid, index, reply_to, seq, context_ids, num_context_prompt, params,
                         num_prompt_tokens)
        self.new_token_ids += new_token_ids
        self.new_ends.append(len(self.new_token_ids))
        if (finish_reason is not None or logprobs or prompt_logprobs or request_stamps
                or num_cached_tokens or embedding is not None):
            self.extras[row] = DetokExtras(finish_reason, stop_reason, list(logprobs),
                                           list(prompt_logprobs), list(request_stamps),
                                           num_cached_tokens, embedding)

    def append_token(self, rid: str, index: int, reply_to: str, seq: int, token: int,
                     context_ids: Sequence[int], num_context_prompt: int,
                     params: DetokParams, num_prompt_tokens: int) -> None:
        """`append` of a row of one token and nothing more (no extras): a decode step's
        usual row, which the served scheduler writes 256 of a step."""
        self._append_row(rid, index, reply_to, seq, context_ids, num_context_prompt, params,
                         num_prompt_tokens)
        self.new_token_ids.append(token)
        self.new_ends.append(len(self.new_token_ids))

    def _append_row(self, rid: str, index: int, reply_to: str, seq: int,
                    context_ids: Sequence[int], num_context_prompt: int, params: DetokParams,
                    num_prompt_tokens: int) -> None:
        """Every column of a row but its new tokens and extras."""
        self.rids.append(rid)
        self.indexes.append(index)
        self.reply_to.append(reply_to)
        self.seqs.append(seq)
        self.context_ids += context_ids
        self.context_ends.append(len(self.context_ids))
        self.num_context_prompt.append(num_context_prompt)
        self.num_prompt_tokens.append(num_prompt_tokens)
        at = self._params_at.get(id(params))
        if at is None:
            at = self._params_at[id(params)] = len(self.params)
            self.params.append(params)
        self.params_of.append(at)

    def batch(self, step: int, stamps: list[float] | None = None, shard: int = 0,
              logprobs: StepLogprobs | None = None) -> TokenBatch:
        return TokenBatch(step, self.rids, self.indexes, self.reply_to, self.seqs,
                          self.new_ends, self.new_token_ids, self.context_ends,
                          self.context_ids, self.num_context_prompt, self.num_prompt_tokens,
                          self.params, self.params_of, self.extras, stamps or [], shard,
                          logprobs)


def token_batch(step: int, items: Sequence[DetokItem], stamps: list[float] | None = None,
                shard: int = 0, logprobs: StepLogprobs | None = None) -> TokenBatch:
    """The batch of these items, each with its own logprobs if any, or its row of
    `logprobs`."""
    columns = TokenColumns()
    for item in items:
        columns.append(item.rid, item.index, item.reply_to, item.seq, item.new_token_ids,
                       item.context_ids, item.num_context_prompt, item.params,
                       item.num_prompt_tokens, item.finish_reason, item.stop_reason,
                       item.logprobs, item.prompt_logprobs, item.request_stamps,
                       item.num_cached_tokens, item.embedding)
    return columns.batch(step, stamps, shard, logprobs)


def batch_items(batch: TokenBatch, rows: Sequence[TokenLogprobs | None] | None = None
                ) -> list[DetokItem]:
    """The batch's rows as DetokItems; `rows`, when given, is each row's logprobs (the
    batch's logprobs columns taken apart, texts and all), which a row whose extras carry
    logprobs of their own must not also have."""
    count = len(batch.rids)
    _check_columns(batch, count)
    if rows is not None and len(rows) != count:
        raise MessageError(f"a batch of {count} rows has logprobs for {len(rows)}")
    new_ids, context_ids, params = batch.new_token_ids, batch.context_ids, batch.params
    no_extras = DetokExtras()
    items = []
    new_start = context_start = 0
    for row, (rid, index, reply_to, seq, new_end, context_end, num_context_prompt,
              num_prompt, at) in enumerate(zip(
                  batch.rids, batch.indexes, batch.reply_to, batch.seqs, batch.new_ends,
                  batch.context_ends, batch.num_context_prompt, batch.num_prompt_tokens,
                  batch.params_of)):
        extras = batch.extras.get(row, no_extras)
        logprobs = extras.logprobs
        if rows is not None and rows[row] is not None:
            if logprobs:
                raise MessageError(f"row {row} ({rid!r}) has logprobs of its own and a row "
                                   "of its batch's")
            logprobs = [rows[row]]
        items.append(DetokItem(
            rid, index, reply_to, seq, new_ids[new_start:new_end],
            context_ids[context_start:context_end], num_context_prompt, params[at],
            num_prompt, extras.finish_reason, extras.stop_reason, logprobs,
            extras.prompt_logprobs, extras.request_stamps, extras.num_cached_tokens,
            extras.embedding))
        new_start, context_start = new_end, context_end
    return items


def _check_columns(batch: TokenBatch, count: int) -> None:
    """Every column a row each, ends that run from 0 to their array's end, params and
    extras that name rows and params there are: bad bytes get a MessageError, not a
    wrong item."""
    for name in ("indexes", "reply_to", "seqs", "new_ends", "context_ends",
                 "num_context_prompt", "num_prompt_tokens", "params_of"):
        if len(getattr(batch, name)) != count:
            raise MessageError(f"a batch of {count} rows has {len(getattr(batch, name))} "
                               f"{name}")
    for name, ids in (("new_ends", batch.new_token_ids), ("context_ends", batch.context_ids)):
        ends = getattr(batch, name)
        if any(b < a for a, b in pairwise([0, *ends])) or (ends[-1] if ends else 0) != len(ids):
            raise MessageError(f"{name} do not run up to the {len(ids)} ids")
    if batch.params_of and not 0 <= min(batch.params_of) <= max(batch.params_of) < len(
            batch.params):
        raise MessageError(f"params_of names params beyond the {len(batch.params)} given")
    if any(not 0 <= row < count for row in batch.extras):
        raise MessageError(f"extras name rows beyond the batch's {count}")

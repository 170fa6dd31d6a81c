"""Stateless incremental detokenization, stop strings and logprob texts.

Any detokenizer replica may take any step's batch, so each DetokItem carries its own
context: the last few token ids before the new ones (common/detok_window.py, applied by
the scheduler). From that window alone the detokenizer finds where the text already sent ends
and what the new tokens add:

    P = text(prompt part of the window)      output text begins after P
    A = text(window)                         text sent so far ends at len(A) - hold
    B = text(window + new tokens)            this delta is B[len(A) - hold : len(B) - hold]

All positions sit in one decoded window, so whatever the window's first token decodes to
on its own (part of a character, a stripped leading space) is the same in P, A and B and
cancels out. `hold` is the stop-string hold-back (longest stop string - 1 characters, when
stop strings are not included in the output), so a partial stop string never reaches a
client. When the item finishes, everything held is sent.

text(ids) leaves out the trailing tokens of a character that is not finished yet. They are
found from the bytes the tokens stand for, not from U+FFFD in the decoded text: a
SentencePiece byte-fallback decoder renders a whole run of byte tokens as U+FFFD while any
of it is incomplete (two euro signs in a row, as six byte tokens, read "€", then U+FFFD
four and five times, then "€€"), so counting replacement characters would send text that
later changes. The same byte spelling lets a window that starts inside a character skip
to the next one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from common.detok_window import MAX_CHAR_BYTES, stop_lookback
from common.messages import (Abort, DetokItem, DetokParams, StepLogprobs, TextDelta,
                             TokenBatch, TokenLogprobs, with_fields)
from common.token_columns import batch_items
from common.token_text import TokenTexts, rust_decoder

_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not a character


# transformers is imported on first use: a detokenizer process decides first whether
# transformers may run without torch (common.model_files.transformers_without_torch)
@cache
def byte_level_chars() -> dict[str, int]:
    """The byte-level BPE alphabet: each character's byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@dataclass(slots=True)
class StopMatch:
    stop: str
    start: int
    end: int


def find_stop(text: str, stop: Sequence[str], start: int) -> StopMatch | None:
    """The stop string that is complete first in text[start:] (earlier in `stop` on a tie):
    generation would have ended there."""
    best: StopMatch | None = None
    for s in stop:
        at = text.find(s, start)
        if at >= 0 and (best is None or at + len(s) < best.end):
            best = StopMatch(s, at, at + len(s))
    return best


def unfinished_bytes(tail: bytes) -> int:
    """How many bytes at the end of `tail` begin a character that needs more bytes."""
    for i in range(1, min(len(tail), MAX_CHAR_BYTES - 1) + 1):
        byte = tail[-i]
        if byte & 0xC0 != 0x80:  # ASCII or a lead byte: the last character starts here
            needed = 1 + (byte >= 0xC0) + (byte >= 0xE0) + (byte >= 0xF0)
            return i if needed > i else 0
    return 0  # continuation bytes only: no later byte can finish them


def is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.decoder is not None:
        # a decoder's state is its JSON config; ByteLevel may sit inside a Sequence
        return b'"ByteLevel"' in backend.decoder.__getstate__()
    return getattr(tokenizer, "byte_decoder", None) is not None  # a Python GPT-2 tokenizer


class TokenBytes:
    """The bytes each token stands for, where the vocabulary spells them out: byte-level
    BPE's printable alphabet, or SentencePiece byte-fallback pieces <0xXX>. Any other token
    is whole characters."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self.special = frozenset(tokenizer.all_special_ids) | frozenset(
            i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if token.special)
        self._pieces: dict[int, bytes] = {}

    def piece(self, token_id: int, skip_special_tokens: bool) -> bytes:
        if skip_special_tokens and token_id in self.special:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._spell(token_id)
        return piece

    def _spell(self, token_id: int) -> bytes:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:  # an id beyond the vocabulary decodes to nothing
            return b""
        if self.byte_level:  # added tokens may hold characters outside the alphabet
            chars = byte_level_chars()
            if all(char in chars for char in token):
                return bytes(chars[char] for char in token)
            return token.encode()
        byte = _BYTE_FALLBACK_PIECE.fullmatch(token)
        return bytes([int(byte.group(1), 16)]) if byte else token.encode()

    def num_unfinished(self, ids: Sequence[int], skip_special_tokens: bool) -> int:
        """How many trailing tokens hold (part of) a character not finished yet."""
        if ids:
            last = self.piece(ids[-1], skip_special_tokens)
            if last and last[-1] < 0x80:  # ends in ASCII: the usual case, decided at once
                return 0
        pieces: list[bytes] = []
        size = 0
        while size < MAX_CHAR_BYTES and len(pieces) < len(ids):
            pieces.append(self.piece(ids[-1 - len(pieces)], skip_special_tokens))
            size += len(pieces[-1])
        pending = unfinished_bytes(b"".join(reversed(pieces)))
        count = 0
        while pending > 0:
            pending -= len(pieces[count])
            count += 1
        return count

    def num_partial_lead(self, ids: Sequence[int], skip_special_tokens: bool) -> int:
        """How many leading tokens are only the continuation of a character begun before."""
        count = 0
        while count < min(len(ids), MAX_CHAR_BYTES - 1):
            piece = self.piece(ids[count], skip_special_tokens)
            if not piece or any(byte & 0xC0 != 0x80 for byte in piece):
                break
            count += 1
        return count


def _text_ids(item: DetokItem) -> list[int]:
    """The new ids that become text: a stop *token* (EOS or stop_token_ids) ends the text
    without appearing in it, unless the request asks for stop strings in the output."""
    ids = list(item.new_token_ids)
    stopped_by_token = item.finish_reason == "stop" and not isinstance(item.stop_reason, str)
    if stopped_by_token and not item.params.include_stop_str_in_output:
        return ids[:-1]
    return ids


def joins_bytes(tokenizer: Any) -> bool:
    """Whether the `tokenizers` decoder behind `tokenizer` only turns byte-level tokens into
    their bytes and those into UTF-8 (ByteLevel alone, as GPT-2's, Llama 3's and Qwen's
    tokenizers have): then a text is its tokens' bytes, decoded."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bytes = TokenBytes(tokenizer)
        self._rust = rust_decoder(tokenizer)
        self.token_text = TokenTexts(tokenizer)
        self._joins_bytes = self._rust is not None and joins_bytes(tokenizer)
        # added tokens: the decoder passes their content through, not their bytes
        self._added = frozenset(getattr(tokenizer, "added_tokens_decoder", {}))

    def process(self, item: DetokItem) -> tuple[TextDelta, Abort | None]:
        if item.embedding is not None:  # an embedding request's answer: no text
            return TextDelta(rid=item.rid, index=item.index, seq=item.seq, text="",
                             token_ids=[], num_prompt_tokens=item.num_prompt_tokens,
                             finish_reason=item.finish_reason,
                             request_stamps=item.request_stamps,
                             embedding=item.embedding), None
        text = self._plain_text(item)
        if text is not None:
            return self._delta(item, text, item.finish_reason, item.stop_reason), None
        return self._windowed(item)

    def _plain_text(self, item: DetokItem) -> str | None:
        """The usual item's text straight from its new tokens' bytes, where decoding the
        window would give the same (the module's doc): a decoder that joins bytes, no
        stop strings, not finishing, a window that ends in an ASCII byte (so no character
        spans it and the new tokens), and new tokens of the vocabulary, not added ones,
        whose bytes are whole characters. Two decodes of the window cost about two thirds
        of an item without logprobs on the 2-CPU box. None: decode the window."""
        params, new = item.params, item.new_token_ids
        if (not self._joins_bytes or params.stop or item.finish_reason is not None
                or not item.context_ids or not self._added.isdisjoint(new)):
            return None
        skip = params.skip_special_tokens
        last = self.bytes.piece(item.context_ids[-1], skip)
        if not last or last[-1] >= 0x80:
            return None
        try:
            text = b"".join([self.bytes.piece(token, skip) for token in new]).decode()
        except UnicodeDecodeError:  # a character not finished yet, or bytes of none
            return None
        return None if text.endswith(REPLACEMENT) else text

    def _windowed(self, item: DetokItem) -> tuple[TextDelta, Abort | None]:
        """The delta from decoding the window (the module's doc): any item."""
        params = item.params
        context, num_prompt = self._resync(item)
        finishing = item.finish_reason is not None
        prompt_end = len(self._text(context[:num_prompt], params, True)) if num_prompt else 0
        seen_end = len(self._text(context, params, False))
        ids = context + _text_ids(item)
        text = self._text(ids, params, finishing)
        if finishing and self.bytes.num_unfinished(ids, params.skip_special_tokens):
            text = text.rstrip(REPLACEMENT)  # a character cut at the end: drop its bytes
        lookback = stop_lookback(params.stop)
        hold = 0 if params.include_stop_str_in_output else lookback
        start = max(prompt_end, seen_end - hold)
        match = find_stop(text, params.stop, max(prompt_end, seen_end - lookback))
        finish_reason, stop_reason, abort = item.finish_reason, item.stop_reason, None
        if match is None:
            end = len(text) if finishing else len(text) - hold
        else:
            end = match.end if params.include_stop_str_in_output else match.start
            finish_reason, stop_reason = "stop", match.stop
            if not finishing and match.end > seen_end:  # new, and the request still runs
                abort = Abort(item.rid, item.index, reason="stop", stop_reason=match.stop)
        return self._delta(item, text[start:max(start, end)], finish_reason, stop_reason), abort

    def _delta(self, item: DetokItem, text: str, finish_reason: str | None,
               stop_reason: str | int | None) -> TextDelta:
        return TextDelta(
            rid=item.rid, index=item.index, seq=item.seq, text=text,
            token_ids=list(item.new_token_ids), num_prompt_tokens=item.num_prompt_tokens,
            finish_reason=finish_reason, stop_reason=stop_reason,
            logprobs=self.with_texts(item.logprobs),
            prompt_logprobs=self.with_texts(item.prompt_logprobs),
            request_stamps=item.request_stamps, num_cached_tokens=item.num_cached_tokens)

    def _resync(self, item: DetokItem) -> tuple[list[int], int]:
        """The window from its first character boundary, unless it starts the sequence."""
        context, num_prompt = list(item.context_ids), item.num_context_prompt
        if num_prompt == item.num_prompt_tokens:
            return context, num_prompt
        skip = self.bytes.num_partial_lead(context, item.params.skip_special_tokens)
        return context[skip:], max(0, num_prompt - skip)

    def _text(self, ids: list[int], params: DetokParams, complete: bool) -> str:
        """The decoded ids; without complete, only up to the last finished character and
        without the U+FFFD of bytes that are no character at its end: those are sent once
        a character follows them, or at the end. So no step's text ends in U+FFFD, and
        the end (which drops a cut character's U+FFFD with them) never takes back text
        sent before: the text is the same however the tokens come in steps, one item of
        a whole FINAL_ONLY completion included."""
        if not complete:
            ids = ids[:len(ids) - self.bytes.num_unfinished(ids, params.skip_special_tokens)]
        if not ids:
            return ""
        if self._rust is not None:
            text = self._rust.decode(ids, skip_special_tokens=params.skip_special_tokens)
        else:
            text = self.tokenizer.decode(
                ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                clean_up_tokenization_spaces=False)
        return text if complete else text.rstrip(REPLACEMENT)

    # --- logprobs ---------------------------------------------------------------------

    def items_of(self, batch: TokenBatch) -> list[DetokItem]:
        """The batch's rows as items, each given its row of the batch's logprob columns,
        whose texts are looked up for the whole batch at once."""
        columns = batch.logprobs
        return batch_items(batch, None if columns is None else self.spelled(columns).rows())

    def spelled(self, columns: StepLogprobs) -> StepLogprobs:
        """The columns with their tokens' texts, looked up in one call."""
        return with_fields(columns, texts=self.token_text.texts(columns.token_ids))

    def with_texts(self, logprobs: list[TokenLogprobs | None]) -> list[TokenLogprobs | None]:
        """Each entry with its tokens' texts, looked up in one pass (None, and an entry
        that has them, stay as they are: a batch's rows get theirs in items_of, the offline
        engine's as their steps come in): a FINAL_ONLY completion brings all of its
        tokens' logprobs at once."""
        if not logprobs:
            return []
        texts = self.token_text.texts([t for lp in logprobs if lp is not None and not lp.texts
                                       for t in lp.token_ids])
        out: list[TokenLogprobs | None] = []
        at = 0
        for lp in logprobs:
            if lp is None or lp.texts:
                out.append(lp)
                continue
            end = at + len(lp.token_ids)
            out.append(TokenLogprobs(lp.token_ids, lp.logprobs, lp.rank, texts[at:end]))
            at = end
        return out

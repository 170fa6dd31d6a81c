"""One token's text as vLLM reports it in logprobs (and the gateway in echoed prompts)."""

from __future__ import annotations

from typing import Any

_SPACE_MARKER = "\u2581"  # SentencePiece's word-start marker


def rust_decoder(tokenizer: Any) -> Any | None:
    """The `tokenizers` Tokenizer behind a transformers fast tokenizer whose decode is that
    Tokenizer's decode plus optional clean-up (which we never ask for): calling it directly
    skips transformers' per-call argument handling, two thirds of a short window's decode
    time, and matters at hundreds of windows a step. None for any other tokenizer."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if isinstance(tokenizer, TokenizersBackend) and \
            type(tokenizer)._decode is TokenizersBackend._decode:
        return tokenizer.backend_tokenizer
    return None


class TokenTexts:
    """decode([id]) with special tokens shown, so a byte token reads U+FFFD, plus the
    leading spaces a SentencePiece decoder strips from the start of a text; cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._rust = rust_decoder(tokenizer)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            self._fill([token_id])
            text = self._texts[token_id]
        return text

    def texts(self, token_ids: list[int]) -> list[str]:
        """Each id's text, the ids not in the table decoded first (a model of dummy weights
        samples over its whole vocabulary)."""
        table = self._texts
        try:  # looked up first: finding the missing ids took longer than the lookup
            return list(map(table.__getitem__, token_ids))
        except KeyError:
            self._fill([t for t in dict.fromkeys(token_ids) if t not in table])
            return list(map(table.__getitem__, token_ids))

    def preload(self, vocab_size: int) -> None:
        """Decode every id below `vocab_size` not in the table yet, for a caller with time
        to spare now: the offline engine while its worker process loads the model. Under
        dummy weights the nano workload's logprobs=1 brings 126k distinct ids, and decoding
        them as they came took its loop 0.29 s on the 2-CPU box (a step's lookups come
        before the next plan)."""
        table = self._texts
        self._fill([t for t in range(vocab_size) if t not in table])

    def _fill(self, token_ids: list[int]) -> None:
        """Through the Rust tokenizer itself where there is one: transformers' decode took
        4.9 us an id on the 2-CPU box, the Rust decode 1.1. Its decode_batch hands even a
        dozen ids to a thread pool (27 us for 12, against 9 one at a time)."""
        if self._rust is not None:
            decode = self._rust.decode
            texts = [decode([t], skip_special_tokens=False) for t in token_ids]
        else:
            texts = [self.tokenizer.decode([t], clean_up_tokenization_spaces=False)
                     for t in token_ids]
        tokens = self.tokenizer.convert_ids_to_tokens(token_ids)
        for token_id, text, token in zip(token_ids, texts, tokens):
            self._texts[token_id] = _with_marked_spaces(text, token or "")


def _with_marked_spaces(text: str, token: str) -> str:
    """The text with the leading spaces its token marks and the decoder stripped."""
    missing = (len(token) - len(token.lstrip(_SPACE_MARKER))
               - (len(text) - len(text.lstrip(" "))))
    return " " * missing + text if missing > 0 else text

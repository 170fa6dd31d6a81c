"""One token's text as vLLM reports it in logprobs (and the gateway in echoed prompts)."""

from __future__ import annotations

from typing import Any

_SPACE_MARKER = "\u2581"  # SentencePiece's word-start marker


class TokenTexts:
    """decode([id]) with special tokens shown, so a byte token reads U+FFFD, plus the
    leading spaces a SentencePiece decoder strips from the start of a text; cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode_one(token_id)
        return text

    def _decode_one(self, token_id: int) -> str:
        text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        token = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        missing = (len(token) - len(token.lstrip(_SPACE_MARKER))
                   - (len(text) - len(text.lstrip(" "))))
        return " " * missing + text if missing > 0 else text

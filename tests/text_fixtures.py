"""Shared test helpers for text: the SmolLM2 tokenizer, a SentencePiece-style byte-fallback
tokenizer, and sample texts in several scripts."""

from __future__ import annotations

import functools
import string
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

# CI clones the repository beside shared/, as here.
SHARED_MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
SMOLLM2_TOKENIZER_DIR = SHARED_MODELS / "qwen3-0.6b-shape"

SAMPLE_TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It was 42 degrees!\n"
             "Pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow.",
    "cjk": "東京は日本の首都です。我喜欢在周末读书和写代码。한국어 문장도 있습니다. 龘靐齉",
    "emoji": "Party 🎉🎉 time! 👩‍👩‍👧‍👦 family, flags 🇫🇷🇯🇵, skin 👍🏽 and 🦄✨🔥 done.",
    "accented": "Ça déjà vu: naïve façade, über Straße, São Paulo, Ångström, "
                "crème brûlée, Dvořák, Łódź, ﬁ ligature, combining e\u0301 and n\u0303.",
    "code": "def f(x: int) -> int:\n    return x ** 2  # square\n\n"
            "for (int i = 0; i < n; ++i) { sum += a[i]; }\n\tprint(f'{x!r:>10}')\n",
    "mixed": "Größe 大小 size — «quotes» “curly” ‘single’ … ½ ∑ ∫ √ π ≈ 3.14 ℃ №5 ☃ 𝔘𝔫𝔦",
}


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, chat template), loaded once."""
    if not (SMOLLM2_TOKENIZER_DIR / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"the test tokenizer is missing: expected {SMOLLM2_TOKENIZER_DIR}/tokenizer.json "
            "(the repository must be checked out beside shared/)")
    return AutoTokenizer.from_pretrained(str(SMOLLM2_TOKENIZER_DIR))


@functools.lru_cache(maxsize=None)
def byte_fallback_tokenizer() -> Any:
    """A SentencePiece-style tokenizer as Llama 2 and Mistral ship it: word-start marker
    ▁, ASCII pieces, and <0xXX> byte pieces for every character not in the vocabulary,
    decoded by Replace, ByteFallback, Fuse and Strip."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["\u2581", *string.ascii_letters, *string.digits, *string.punctuation,
                  "\u2581the", "\u2581a", "é", "日", "本"]:
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "),
                                         decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")

"""The detokenizer service: its core (state and decisions, no I/O) and its asyncio shell.

What code outside the services (benchmarks/) may use is defined here; the modules behind
it may change shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.messages import TextDelta, TokenBatch


def batch_detokenizer(tokenizer: Any) -> Callable[[TokenBatch], list[TextDelta]]:
    """What a detokenizer replica does with each TokenBatch it reads, less the I/O: its
    rows as items, each item's text delta (`headrace bench detokenizer` times it)."""
    from services.detokenizer.core import Detokenizer

    detokenizer = Detokenizer(tokenizer)
    return lambda batch: [detokenizer.process(item)[0]
                          for item in detokenizer.items_of(batch)]

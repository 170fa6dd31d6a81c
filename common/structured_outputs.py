"""Structured outputs: a request's `structured_outputs` (common/sampling_params.py) as an
xgrammar Grammar. The one translation the tokenizer stage (which refuses what xgrammar
cannot parse, so a bad grammar never reaches the worker) and the worker (which compiles
and enforces it: services/worker/grammar.py) share.

- json: the schema, in xgrammar's strict mode (properties the schema does not name are
  refused) and without free whitespace (vLLM's disable_any_whitespace): the output is
  compact JSON, and a small model cannot wander into endless blanks between tokens.
  xgrammar (0.2.8) gets one thing wrong: a string with minLength or maxLength admits raw
  control characters and no escapes (mlc-ai/xgrammar issue 800); a pattern does not.
- json_object: any JSON object, compact in the same way.
- regex, grammar: as xgrammar reads them (its regex dialect; EBNF/GBNF with a root rule).
- choice: a grammar whose root is one of the strings, literally.

xgrammar imports torch, so it is imported on first use: a tokenizer replica that never sees
a structured request stays torch-free (tests/test_architecture.py); the first one costs it
the import, about 2.5 s and 220 MB, once.
"""

from __future__ import annotations

import json
import os
import re
import sys
from types import ModuleType
from typing import Any

from common.model_files import allow_torch
from common.sampling_params import SamplingError

BACKENDS = ("auto", "xgrammar")  # --guided-decoding-backend; auto is xgrammar
_PARAM = "structured_outputs"
# xgrammar's messages start with a timestamp and its C++ source position
_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: .*? is false: )?")


def load_xgrammar() -> ModuleType:
    """xgrammar, imported on first use. Under it, tvm-ffi would compile a torch extension at
    import time where torch lacks its DLPack exchange hook (older builds): a compiler run
    in the middle of serving, for a speed-up of calls that hand it tensors, which the
    bitmask calls do well enough without."""
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    allow_torch()  # the tokenizer stage kept it out of transformers
    import xgrammar

    return xgrammar


def xgrammar_loaded() -> bool:
    """Whether a structured request has brought xgrammar (and torch) into this process."""
    return "xgrammar" in sys.modules


def spec_key(spec: dict[str, Any]) -> str:
    """One string per distinct spec, whatever its key order: the compile cache's key."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def to_grammar(spec: dict[str, Any]) -> Any:
    """The xgrammar Grammar of a spec SamplingParams has validated (one key); a
    SamplingError naming structured_outputs where xgrammar cannot parse it."""
    ((kind, value),) = spec.items()
    grammar = load_xgrammar().Grammar
    try:
        if kind == "json":
            return grammar.from_json_schema(json.dumps(value), any_whitespace=False)
        if kind == "json_object":
            return grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
        if kind == "regex":
            return grammar.from_regex(value)
        if kind == "choice":
            return grammar.from_ebnf(choice_ebnf(value))
        return grammar.from_ebnf(value)
    except (RuntimeError, ValueError) as e:  # xgrammar's parse errors are RuntimeErrors
        raise SamplingError(f"{_PARAM}.{kind} is invalid: {reason(e)}", _PARAM) from None


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b": a JSON string literal is an EBNF one (same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def reason(error: Exception) -> str:
    """xgrammar's message without its C++ source position."""
    return _SOURCE_PREFIX.sub("", str(error).strip())

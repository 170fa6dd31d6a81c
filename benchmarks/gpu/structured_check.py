"""Structured output and tool calls over HTTP against a running `headrace serve`: every
constrained request, under greedy and temperature sampling and mixed in one batch with
plain ones, must come back parsing and matching what it asked for.

    python benchmarks/gpu/structured_check.py --base-url http://127.0.0.1:8800 --json OUT

The model may have random weights: the mask alone must make the outputs valid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any

import aiohttp

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}
TOOL = {"type": "function", "function": {"name": "book", "parameters": SCHEMA}}
REGEX = r"\d{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]


def conforms(value: Any) -> bool:
    """SCHEMA, checked by hand (the device image has no jsonschema)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "city"}
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and 0 <= value["age"] <= 120 and value["city"] in SCHEMA["properties"]["city"]["enum"])


def cases() -> list[tuple[str, dict[str, Any], Any]]:
    """(name, extra body, check of the message) for greedy and four seeds."""
    out = []
    samplings = [("greedy", {"temperature": 0})] + [
        (f"t1-seed{s}", {"temperature": 1.0, "seed": s}) for s in range(4)]
    for tag, sampling in samplings:
        out += [
            (f"json_schema/{tag}", {**sampling, "response_format": {
                "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
             lambda m: conforms(json.loads(m["content"]))),
            (f"json_object/{tag}", {**sampling, "response_format": {"type": "json_object"}},
             lambda m: isinstance(json.loads(m["content"]), dict)),
            (f"guided_regex/{tag}", {**sampling, "guided_regex": REGEX},
             lambda m: re.fullmatch(REGEX, m["content"]) is not None),
            (f"guided_choice/{tag}", {**sampling, "guided_choice": CHOICES},
             lambda m: m["content"] in CHOICES),
            (f"tool_named/{tag}", {**sampling, "tools": [TOOL], "tool_choice": {
                "type": "function", "function": {"name": "book"}}},
             lambda m: conforms(json.loads(m["tool_calls"][0]["function"]["arguments"]))),
            (f"tool_required/{tag}", {**sampling, "tools": [TOOL], "tool_choice": "required"},
             lambda m: all(c["function"]["name"] == "book"
                           and conforms(json.loads(c["function"]["arguments"]))
                           for c in m["tool_calls"]) and m["tool_calls"]),
            (f"plain/{tag}", {**sampling, "max_tokens": 32}, lambda m: True),
        ]
    return out


async def ask(session: aiohttp.ClientSession, url: str, name: str, extra: dict[str, Any],
              check: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 200,
            "messages": [{"role": "user", "content": "Give me a person as JSON."}], **extra}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        answer = await response.json()
    if response.status != 200:
        return {"case": name, "ok": False, "status": response.status, "answer": answer}
    choice = answer["choices"][0]
    try:
        ok = bool(check(choice["message"]))
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    return {"case": name, "ok": ok, "finish_reason": choice["finish_reason"],
            "message": choice["message"], "tokens": answer["usage"]["completion_tokens"]}


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8800")
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(ask(session, args.base_url, *case)
                                         for case in cases()))
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not r["ok"]]
    summary = {"requests": len(results), "failed": len(failed), "seconds": elapsed,
               "results": results}
    for r in results:
        print(f"{'ok ' if r['ok'] else 'BAD'} {r['case']:<26} "
              f"{json.dumps(r.get('message', r.get('answer')))[:110]}")
    print(f"{len(results) - len(failed)}/{len(results)} valid in {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

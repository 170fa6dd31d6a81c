"""A streaming completions client for the fault and shutdown tests: it records each
stream's text, its error event, whether [DONE] came, and when each chunk arrived."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from tests.e2e_fixtures import MODEL_NAME


@dataclass
class Streamed:
    text: str = ""
    error: str | None = None  # an error event's message, or how the connection broke
    done: bool = False  # the stream ended with [DONE]
    chunk_times: list[float] = field(default_factory=list)
    ended_at: float = 0.0

    def longest_gap(self, after: float) -> float:
        times = [after] + [t for t in self.chunk_times if t >= after]
        return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: str,
                     out: Streamed, max_tokens: int) -> None:
    """A greedy streamed completion, its events recorded in `out` as they come."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {await response.text()}"
            else:
                await read_events(response, out)
    except (aiohttp.ClientError, ConnectionError) as e:  # the gateway itself went away
        out.error = f"{type(e).__name__}: {e}"
    out.ended_at = time.monotonic()


async def read_events(response: aiohttp.ClientResponse, out: Streamed) -> None:
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[len(b"data: "):].strip()
        if payload == b"[DONE]":
            out.done = True
            return
        event = json.loads(payload)
        if "error" in event:
            out.error = event["error"]["message"]
        else:
            out.text += event["choices"][0]["text"]
            out.chunk_times.append(time.monotonic())

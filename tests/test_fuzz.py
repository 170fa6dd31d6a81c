"""Hostile input against a real `headrace serve` of the demo model: request bodies made by
hypothesis (wrong types, numeric edges, NaN and infinities, odd strings and nesting, unknown
fields) and by hand (framing, methods, paths, raw bytes). Every answer must be a 4xx with
an OpenAI-style error, or a well-formed answer; never a 5xx, a hang or a dead process.

`make test` sends a sample of QUICK_EXAMPLES hypothesis bodies per endpoint; the full sample
of EXAMPLES per endpoint runs under `make test-long` (the same test, marked long).
HEADRACE_FUZZ_EXAMPLES sets the full sample's size (default below); the cases are
derandomized, so a run is the same on every machine. With
HEADRACE_FUZZ_TABLE set, the statuses each endpoint answered are written there as a
markdown table (benchmarks/fuzz-cpu/run.sh, the long run).
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, serve_args, serving

EXAMPLES = int(os.environ.get("HEADRACE_FUZZ_EXAMPLES", "500"))  # x4 endpoints, make test-long
QUICK_EXAMPLES = 100  # x4 endpoints, make test: the smaller sample keeps CI under its limit
ANSWER_TIMEOUT_S = 30.0
MAX_MODEL_LEN = 64  # bounds what any accepted request can make the CPU generate
RSS_GROWTH_LIMIT = 300 * 2**20

INTS = [0, 1, -1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -2**63 - 1,
        10**30, -10**30]
FLOATS = [0.0, -0.0, 0.5, 1.5, -2.5, 1e-320, 1e308, -1e308, float("inf"), float("-inf"),
          float("nan")]
TEXTS = ["", " ", "Hi", "\x00", "\ud800", "é" * 40, "<|im_end|>", "{{ x }}", "a" * 5000]
SAMPLING = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop",
            "stop_token_ids", "seed", "logprobs", "prompt_logprobs", "stream", "stream_options",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
            "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "priority",
            "user", "model"]
FIELDS = {  # each endpoint's own fields, and one it does not know
    "/v1/completions": [*SAMPLING, "prompt", "echo", "no_such_field"],
    "/v1/chat/completions": [*SAMPLING, "messages", "max_completion_tokens", "top_logprobs",
                             "add_generation_prompt", "no_such_field"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                  "no_such_field"],
    "/detokenize": ["model", "tokens", "no_such_field"],
}

edges = st.one_of(st.sampled_from(INTS), st.sampled_from(FLOATS), st.sampled_from(TEXTS),
                  st.booleans(), st.none())
scalars = st.one_of(edges, st.integers(), st.floats(), st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
near_valid = st.one_of(edges, st.lists(edges, max_size=5), st.integers(-3, 70),
                       st.floats(-3, 3), values)
messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "x"]), values),
    "content": st.one_of(st.sampled_from(TEXTS), values)}), max_size=3)

BASES = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL_NAME, "max_tokens": 2,
                             "messages": [{"role": "user", "content": "Hi"}]},
    "/tokenize": {"model": MODEL_NAME, "prompt": "Hi"},
    "/detokenize": {"model": MODEL_NAME, "tokens": [1, 2]},
}


@st.composite
def bodies(draw: st.DrawFn, path: str) -> Any:
    """Mostly a valid body with a few fields changed, so the cases get past the first
    check; sometimes not an object at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(values)
    body = dict(BASES[path])
    for name in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3)):
        if name in body and draw(st.integers(0, 4)) == 0:
            del body[name]
        elif name == "messages":
            body[name] = draw(st.one_of(messages, values))
        else:
            body[name] = draw(near_valid)
    return body


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    args = serve_args(root / "run")
    args[args.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
    # input, not load, is under test here: n=128 must not look like an overload
    args[args.index("--max-queue-len") + 1] = "100000"
    with serving(args, root / "serve.log") as server:
        yield server


@pytest.fixture(scope="module")
def statuses() -> Iterator[Counter[tuple[str, int]]]:
    """(endpoint, status) -> how many answers; written out when HEADRACE_FUZZ_TABLE is set."""
    counts: Counter[tuple[str, int]] = Counter()
    start = time.monotonic()
    yield counts
    if table := os.environ.get("HEADRACE_FUZZ_TABLE"):
        Path(table).write_text(status_table(counts, time.monotonic() - start))


def status_table(counts: Counter[tuple[str, int]], seconds: float) -> str:
    codes = sorted({code for _, code in counts})
    paths = sorted({path for path, _ in counts})
    lines = [f"{EXAMPLES} hypothesis bodies per endpoint plus {len(FRAMING)} framing cases, "
             f"{sum(counts.values())} requests in {seconds / 60:.1f} min on "
             f"{platform.machine()} ({os.cpu_count()} CPUs), Python {platform.python_version()}.",
             "", "| endpoint | " + " | ".join(map(str, codes)) + " | total |",
             "|---|" + "---:|" * (len(codes) + 1)]
    for path in paths:
        row = [counts[path, code] for code in codes]
        lines.append(f"| {path} | " + " | ".join(map(str, row)) + f" | {sum(row)} |")
    return "\n".join(lines) + "\n"


def post(server: ServerProcess, path: str, raw: bytes,
         headers: dict[str, str] | None = None, method: str = "POST") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=ANSWER_TIMEOUT_S)
    try:
        conn.request(method, path, raw, {"Content-Type": "application/json",
                                         "Authorization": f"Bearer {API_KEY}",
                                         **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def check_answer(path: str, body: Any, status: int, raw: bytes) -> None:
    shown = f"{path} {json.dumps(body, allow_nan=True)[:300]} -> {status} {raw[:300]!r}"
    assert status < 500, shown
    if status >= 400:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"], shown
        assert isinstance(error["type"], str), shown
        return
    assert status == 200, shown
    if raw.startswith(b"data: "):  # a stream: whole events, the last one [DONE]
        events = [e for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]", shown
        for event in events[:-1]:
            json.loads(event.removeprefix("data: "))
    else:
        json.loads(raw)


def gateway_rss(server: ServerProcess) -> int:
    def service(process: psutil.Process) -> str | None:
        cmd = process.cmdline()
        return cmd[cmd.index("services.cli") + 1] if "services.cli" in cmd[:-1] else None
    children = psutil.Process(server.process.pid).children(recursive=True)
    return sum(c.memory_info().rss for c in children if service(c) == "gateway")


def fuzz_endpoint(server: ServerProcess, path: str, statuses: Counter, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def one(body: Any) -> None:
        status, raw = post(server, path, json.dumps(body, allow_nan=True).encode())
        statuses[path, status] += 1
        check_answer(path, body, status, raw)
    one()


@pytest.mark.parametrize("path", list(BASES))
@pytest.mark.parametrize("examples", [pytest.param(QUICK_EXAMPLES, id="quick"),
                                      pytest.param(EXAMPLES, id="full", marks=pytest.mark.long)])
def test_fuzzed_bodies_get_a_4xx_or_an_answer(fuzzed: ServerProcess, path: str, examples: int,
                                              statuses: Counter):
    """`make test` sends the quick sample, `make test-long` the full one (EXAMPLES)."""
    before = gateway_rss(fuzzed)
    assert before > 0
    fuzz_endpoint(fuzzed, path, statuses, examples)
    assert fuzzed.status("/health") == 200, fuzzed.log_tail()
    assert gateway_rss(fuzzed) - before < RSS_GROWTH_LIMIT


FRAMING = [
    ("POST", "/v1/completions", b"", {}),
    ("POST", "/v1/completions", b"{", {}),
    ("POST", "/v1/completions", b"\xff\xfe\x00", {}),
    ("POST", "/v1/completions", b'{"prompt": "Hi"}', {"Content-Type": "text/plain"}),
    ("POST", "/v1/completions", b"[]" * 10, {}),
    ("POST", "/v1/completions", b'{"prompt": "x", "prompt": 5}', {}),
    ("POST", "/v1/completions", json.dumps({"prompt": "a" * 70_000}).encode(), {}),
    ("POST", "/v1/completions", b"{" * 100_000, {}),
    ("POST", "/v1/completions", b'{"prompt": "Hi"}', {"Authorization": "Bearer wrong"}),
    ("POST", "/v1/completions", b'{"prompt": "Hi"}', {"Authorization": "Basic x"}),
    ("GET", "/v1/completions", b"", {}),
    ("PUT", "/v1/chat/completions", b"{}", {}),
    ("POST", "/v1/nothing", b"{}", {}),
    ("POST", "/v1/completions/../../etc/passwd", b"{}", {}),
    ("GET", "/v1/models/..%2F..", b"", {}),
    ("POST", "/tokenize", b'{"prompt": ["a", 1]}', {}),
    ("POST", "/tokenize", b'{"prompt": [[1, 2]]}', {}),
    ("POST", "/tokenize", b'{"messages": "Hi"}', {}),
    ("POST", "/detokenize", b'{"tokens": [-1]}', {}),
    # found by the long run (benchmarks/fuzz-cpu): both were 500s
    ("POST", "/tokenize", b'{"prompt": "\\ud800"}', {}),
    ("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
         "temperature": 2**64}).encode(), {}),
    ("POST", "/detokenize", b'{"tokens": [99999999999]}', {}),
    # issue 34's hostile run: each of these was a 500, or no answer at all
    ("POST", "/v1/completions", b"[" * 5000 + b"]" * 5000, {}),
    ("POST", "/tokenize", b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", {}),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe bytes"}', {}),
    ("POST", "/v1/completions", b'{"prompt": "Hi"}', {"Content-Encoding": "gzip"}),
    ("POST", "/v1/completions", b'{"prompt": "Hi"}', {"Content-Encoding": "br"}),
    ("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "Hi", "name": 2**70}],
         "max_tokens": 2}).encode(), {}),
    ("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "Hi", "extra": {"n": 2**64}}],
         "max_tokens": 2}).encode(), {}),
    ("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2, "x": ' + b"9" * 400 + b"}",
     {}),
    ("POST", "/v1/chat/completions", b'{"max_tokens": 2, "messages": [{"role": "user", '
     b'"content": "Hi", "x": ' + b"[" * 400 + b"]" * 400 + b"}]}", {}),
    ("POST", "/tokenize", b'{"messages": [{"role": "user", "content": "Hi", "x": '
     + b"{\"a\": " * 400 + b"1" + b"}" * 400 + b"}]}", {}),
]


@pytest.mark.parametrize("method,path,raw,headers", FRAMING)
def test_framing_methods_paths_and_bytes(fuzzed: ServerProcess, method: str, path: str,
                                         raw: bytes, headers: dict[str, str],
                                         statuses: Counter):
    status, answer = post(fuzzed, path, raw, headers, method)
    statuses["framing", status] += 1
    assert 400 <= status < 500 or status == 200, (status, answer[:300])
    if status >= 400 and answer.startswith(b"{"):
        assert json.loads(answer)["error"]["message"]

"""`headrace serve --api-server-count N` runs N gateway processes on one port; the kernel
spreads connections over them and each answers through its own reply stream, and a scrape
of /metrics, whichever process takes it, counts the requests all of them served."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e_fixtures import start_server
from tests.tiny_models import make_tiny_model

REQUESTS = 40


def complete(url: str, model: str) -> dict:
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:  # a new connection each
        return json.loads(response.read())


def test_gateway_replicas_share_one_port(tmp_path):
    model = str(make_tiny_model(tmp_path, "llama"))
    server = start_server(["serve", model, "--api-server-count", "2",
                           "--num-gpu-blocks-override", "64", "--run-dir",
                           str(tmp_path / "run")], tmp_path / "serve.log")
    try:
        server.wait_for("/health", (200,), timeout_s=180)
        bodies = [complete(server.url, model) for _ in range(REQUESTS)]
        assert all(b["usage"]["completion_tokens"] == 3 for b in bodies)
        answered_by = {r.get("replica") for r in server.log_records()
                       if r.get("service") == "gateway" and r.get("event") == "request finished"}
        # each connection lands on either process: all 40 on one has odds of 2**-39
        assert answered_by == {"0", "1"}, server.log_tail()
        assert_heaps_frozen_after_loading(server.log_records())
        for _ in range(8):  # each scrape on a new connection, so on either process
            counts = served_counts(server.url, model)
            assert counts == {"success": REQUESTS, "e2e": REQUESTS,
                              "step stages": counts["step stages"]}, counts
            assert counts["step stages"] >= REQUESTS  # one step's stamps per reply at least
    finally:
        assert not server.stop(), "processes left behind"


def served_counts(url: str, model: str) -> dict[str, float]:
    """What every gateway process counted (the series are labelled with the served name:
    the model's path here)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    shard_0 = (("model_name", model), ("shard", "0"))
    return {"success": samples["headrace:request_success_total",
                               (("finished_reason", "length"), *shard_0)],
            "e2e": samples["headrace:e2e_request_latency_seconds_count", shard_0],
            "step stages": samples["headrace:stage_seconds_count",
                                   (("model_name", model), ("stage", "step"))]}


def assert_heaps_frozen_after_loading(records: list[dict]) -> None:
    """Every process froze its heap twice: after its imports, and again once it had loaded
    what it serves with (transformers and torch come in then), so that a collection while
    serving walks neither."""
    freezes: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("event") == "heap frozen":
            freezes.setdefault((r["service"], r["replica"]), []).append(r)
    assert {service for service, _ in freezes} == {"worker", "scheduler", "tokenizer",
                                                   "detokenizer", "gateway"}
    for process, seen in freezes.items():
        assert len(seen) == 2, (process, seen)
        imports, loaded = seen
        assert loaded["modules"] > imports["modules"] and loaded["frozen"] > imports["frozen"]

"""`headrace serve --api-server-count N` runs N gateway processes on one port; the kernel
spreads connections over them and each answers through its own reply stream."""

from __future__ import annotations

import json
import urllib.request

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
    finally:
        assert not server.stop(), "processes left behind"

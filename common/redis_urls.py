"""What a stage does with its Redis URL before the bus uses it: a form safe to log, and a
first call that tells wrong credentials from a Redis that is merely not up yet.

The URL carries what redis-py's `from_url` reads: `rediss://` for TLS, with its options
as query parameters (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`,
`ssl_check_hostname`), and an ACL user as `rediss://USER:PASSWORD@HOST:PORT/0`
(deploy/redis-acl.conf has each stage's user).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import (AuthenticationError, NoPermissionError, RedisClusterException,
                              RedisError)

from common.redis_cluster import blocking_client

CHECK_TIMEOUT_S = 2.0


class RedisRefused(RuntimeError):
    """Redis answered, and refused this process's credentials or rights: a retry cannot
    help, the deployment must change."""


def redacted(url: str) -> str:
    """`url` with its password replaced by `***`, for logs and error messages."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def check_credentials(url: str) -> None:
    """One PING with the URL's credentials. Raises RedisRefused when Redis rejects them
    (WRONGPASS, a disabled user) or the user may not even PING; any other failure
    passes, since the bus's own retries wait for a Redis that is not up yet."""
    try:
        client = blocking_client(url, None, CHECK_TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    except (AuthenticationError, NoPermissionError) as e:
        raise RedisRefused(f"Redis at {redacted(url)} refused this process: {e}") from None
    except (RedisError, RedisClusterException):
        pass

"""What a stage does with its Redis URL before the bus uses it: a form safe to log, and a
first call that tells wrong credentials from a Redis that is merely not up yet.

The URL carries what redis-py's `from_url` reads: `rediss://` for TLS, with its options
as query parameters (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`,
`ssl_check_hostname`), and an ACL user as `rediss://USER:PASSWORD@HOST:PORT/0`
(deploy/redis-users.conf has each stage's user). Cluster and Sentinel URLs spell them the
same way (common/redis_url_options.py).
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import (AuthenticationError, NoPermissionError, RedisClusterException,
                              RedisError)

from common.redis_cluster import blocking_client
from common.redis_sentinel import is_sentinel_url, sentinel_refusal

CHECK_TIMEOUT_S = 2.0
_QUERY_SECRET = re.compile(r"((?:^|&)sentinel_password=)[^&]*")


class RedisRefused(RuntimeError):
    """Redis answered, and refused this process's credentials or rights: a retry cannot
    help, the deployment must change."""


def redacted(url: str) -> str:
    """`url` with its passwords (the user's, and a sentinel_password option) replaced by
    `***`, for logs and error messages."""
    given = urlsplit(url)
    parts = given._replace(query=_QUERY_SECRET.sub(r"\1***", given.query))
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{hosts}")
    return url if parts == given else urlunsplit(parts)  # unix:/// would lose a slash


def check_credentials(url: str) -> None:
    """One PING with the URL's credentials. Raises RedisRefused when Redis rejects them
    (WRONGPASS, a disabled user) or the user may not even PING; any other failure
    passes, since the bus's own retries wait for a Redis that is not up yet. Behind
    Sentinel, the sentinels' own credentials are checked first."""
    if is_sentinel_url(url) and (refusal := sentinel_refusal(url)) is not None:
        raise RedisRefused(f"the sentinels of {redacted(url)} refused this process: {refusal}")
    try:
        client = blocking_client(url, None, CHECK_TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    except (AuthenticationError, NoPermissionError) as e:
        raise RedisRefused(f"Redis at {redacted(url)} refused this process: {e}") from None
    except RedisClusterException as e:
        # a cluster client wraps what each startup node answered in one exception
        if isinstance(e.__cause__, (AuthenticationError, NoPermissionError)):
            raise RedisRefused(f"Redis at {redacted(url)} refused this process: "
                               f"{e.__cause__}") from None
    except RedisError:
        pass

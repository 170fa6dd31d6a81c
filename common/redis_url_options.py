"""What a cluster or Sentinel URL says besides its hosts, spelled as rediss:// spells it:
an `s` after `redis` for TLS (`rediss+cluster://`, `rediss+sentinel://`), the TLS options
as the same query parameters (`ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`,
`ssl_cert_reqs`, `ssl_check_hostname`), and an ACL user as `USER:PASSWORD@` before the
hosts. redis-py's `from_url` reads one host, so these URLs are read here."""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote

TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
               "ssl_check_hostname")
CERT_REQS = ("none", "optional", "required")


def is_tls(parts: SplitResult) -> bool:
    return parts.scheme.startswith("rediss+")


def query_options(parts: SplitResult, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """The URL's query as a dict: the TLS options (only on a TLS scheme) and `allowed`;
    any other name, or one given twice, is a ValueError naming it."""
    known = (TLS_OPTIONS if is_tls(parts) else ()) + allowed
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if name not in known:
            hint = " (TLS options need the rediss+ scheme)" if name in TLS_OPTIONS else ""
            raise ValueError(f"unknown query option {name!r}{hint}; "
                             f"known: {', '.join(known) or 'none'}")
        if name in options:
            raise ValueError(f"query option {name!r} given twice")
        options[name] = value
    return options


def tls_options(parts: SplitResult, query: dict[str, str]) -> dict[str, Any]:
    """The redis-py connection arguments of the URL's TLS, from its `query_options`: {}
    on a plain scheme."""
    if not is_tls(parts):
        return {}
    given: dict[str, Any] = {name: value for name, value in query.items()
                             if name in TLS_OPTIONS}
    if given.get("ssl_cert_reqs", "required") not in CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}, "
                         f"got {given['ssl_cert_reqs']!r}")
    if "ssl_check_hostname" in given:
        flag = given["ssl_check_hostname"].lower()
        if flag not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"ssl_check_hostname must be true or false, got {flag!r}")
        given["ssl_check_hostname"] = flag in ("true", "1", "yes")
    return {"ssl": True, **given}


def credentials(parts: SplitResult) -> dict[str, str | None]:
    """The ACL user and password before the hosts (percent-decoded), None where absent."""
    userinfo, at, _ = parts.netloc.rpartition("@")
    user, colon, secret = userinfo.partition(":")
    return {"username": unquote(user) or None, "password": unquote(secret) if colon else None}


def host_ports(parts: SplitResult, shape: str) -> list[tuple[str, int]]:
    """The comma-separated HOST:PORT list after the credentials."""
    addresses = []
    for address in parts.netloc.rpartition("@")[2].split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{address!r} is not HOST:PORT in {shape}")
        addresses.append((host, int(port)))
    return addresses

"""Slow and half-open clients against a real gateway: a connection that trickles its
headers (or sends none) is closed after --timeout-keep-alive, a body that does not arrive
is a 408 after --body-timeout, and a crowd of such connections does not keep a normal
request from being answered."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from common.redis_server import EmbeddedRedis
from services.demo import demo_model_path
from tests.e2e_fixtures import MODEL_NAME, ServerProcess, start_server

TIMEOUT_S = 1.0
HALF_OPEN = 200


@pytest.fixture(scope="module")
def impatient(embedded_redis: EmbeddedRedis, tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("impatient")
    server = start_server(["gateway", demo_model_path(), "--redis-url", embedded_redis.url,
                           "--served-model-name", MODEL_NAME,
                           "--timeout-keep-alive", str(TIMEOUT_S),
                           "--body-timeout", str(TIMEOUT_S)], root / "gateway.log")
    try:
        server.wait_for("/version", (200,), timeout_s=120)
        yield server
    finally:
        server.stop()


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    return sock


def test_headers_that_never_end_get_the_connection_closed(impatient):
    with connect(impatient) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        start = time.monotonic()
        assert sock.recv(1024) == b""  # closed, nothing answered
        assert time.monotonic() - start < TIMEOUT_S + 3


def test_a_body_that_never_arrives_is_408(impatient):
    with connect(impatient) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--body-timeout" in answer


def closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed: an orderly end (FIN), or a reset, which a close with bytes in
    flight sends instead (a CI run saw one)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def test_half_open_connections_do_not_starve_a_request(impatient):
    crowd = [connect(impatient) for _ in range(HALF_OPEN)]
    try:
        for sock in crowd[::2]:
            sock.sendall(b"GET /version HTTP/1.1\r\nHo")
        start = time.monotonic()
        with urllib.request.urlopen(impatient.url + "/version", timeout=5) as response:
            assert response.status == 200
        assert time.monotonic() - start < 2
        time.sleep(TIMEOUT_S + 1)
        closed = 0
        for sock in crowd:
            sock.settimeout(3)  # one still held open fails here, timing out
            closed += closed_by_peer(sock)
        assert closed == HALF_OPEN  # every one of them let go
    finally:
        for sock in crowd:
            sock.close()

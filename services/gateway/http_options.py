"""The HTTP server settings vLLM takes from its uvicorn and FastAPI options: CORS
(--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials), a path
prefix behind a proxy (--root-path), TLS (--ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
--ssl-cert-reqs), the log levels (--uvicorn-log-level, --disable-log-requests) and
X-Request-Id on every answer (--enable-request-id-headers)."""

from __future__ import annotations

import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from common.config import ServerConfig

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

REQUEST_LOGGER = "headrace.requests"  # the gateway's lines of each request
ACCESS_LOGGER = "headrace.access"  # one line per HTTP request, at debug and trace
# what a "*" of --allowed-methods allows, spelled out in a preflight's answer
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
PREFLIGHT_MAX_AGE_S = 600
REQUEST_ID = "X-Request-Id"
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR,
              "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG,
              "trace": logging.DEBUG}  # Python's logging has nothing below debug


def with_http_options(app: web.Application, server: ServerConfig) -> web.Application:
    """`app` with CORS and, under --root-path, every route also served under the prefix
    (call it once every route is added)."""
    cors = Cors(server)
    app.middlewares.insert(0, cors.preflight)
    app.on_response_prepare.append(cors.add_headers)
    if server.enable_request_id_headers:
        app.on_response_prepare.append(add_request_id)
    if server.root_path:
        for route in list(app.router.routes()):
            app.router.add_route(route.method, server.root_path + route.resource.canonical,
                                 route.handler)
    return app


def route_path(request: web.Request, root_path: str | None) -> str:
    """The request's path without --root-path (a proxy may or may not strip it)."""
    path = request.path
    if root_path and (path == root_path or path.startswith(root_path + "/")):
        return path[len(root_path):] or "/"
    return path


class Cors:
    """What a browser needs to call this API from another origin, as vLLM's (Starlette's)
    CORS middleware answers: a preflight OPTIONS is answered here (200, or 400 naming what
    is not allowed), and every response to a request from an allowed origin carries
    Access-Control-Allow-Origin. A request from an origin not allowed is still served;
    without the header the browser keeps the answer from its page."""

    def __init__(self, server: ServerConfig) -> None:
        self.origins = set(server.allowed_origins)
        self.any_origin = "*" in self.origins
        self.methods = (ALL_METHODS if "*" in server.allowed_methods
                        else tuple(m.upper() for m in server.allowed_methods))
        self.headers = {h.lower() for h in server.allowed_headers}
        self.any_header = "*" in self.headers
        self.credentials = server.allow_credentials

    def allows(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def origin_headers(self, origin: str) -> dict[str, str]:
        """Credentials need the origin itself: browsers refuse "*" with them."""
        if self.any_origin and not self.credentials:
            return {hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: "*"}
        headers = {hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: origin, hdrs.VARY: "Origin"}
        if self.credentials:
            headers[hdrs.ACCESS_CONTROL_ALLOW_CREDENTIALS] = "true"
        return headers

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        method = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_METHOD)
        origin = request.headers.get(hdrs.ORIGIN)
        if request.method != "OPTIONS" or method is None or origin is None:
            return await handler(request)
        asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS, "")
        names = [h.strip().lower() for h in asked.split(",") if h.strip()]
        refused = [what for what, ok in (
            ("origin", self.allows(origin)), ("method", method.upper() in self.methods),
            ("headers", self.any_header or all(h in self.headers for h in names))) if not ok]
        headers = {hdrs.ACCESS_CONTROL_ALLOW_METHODS: ", ".join(self.methods),
                   hdrs.ACCESS_CONTROL_MAX_AGE: str(PREFLIGHT_MAX_AGE_S)}
        if names:
            headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = asked
        if self.allows(origin):
            headers.update(self.origin_headers(origin))
        if refused:
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}",
                                headers=headers)
        return web.Response(text="OK", headers=headers)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """Before any response's headers leave, streams included."""
        origin = request.headers.get(hdrs.ORIGIN)
        if origin is not None and self.allows(origin) \
                and hdrs.ACCESS_CONTROL_ALLOW_ORIGIN not in response.headers:
            response.headers.update(self.origin_headers(origin))


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """--enable-request-id-headers, as vLLM's middleware: the request's X-Request-Id
    echoed, or a fresh one."""
    response.headers[REQUEST_ID] = request.headers.get(REQUEST_ID) or uuid.uuid4().hex


def tls_context(server: ServerConfig) -> ssl.SSLContext | None:
    """None for plain HTTP."""
    if server.ssl_certfile is None or server.ssl_keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(server.ssl_certfile, server.ssl_keyfile)
    if server.ssl_ca_certs:
        context.load_verify_locations(server.ssl_ca_certs)
    context.verify_mode = ssl.VerifyMode(server.ssl_cert_reqs)
    return context


def apply_log_levels(server: ServerConfig) -> logging.Logger | None:
    """Set the process's levels from --uvicorn-log-level (when given: otherwise
    HEADRACE_LOG_LEVEL's stays) and --disable-log-requests; the access logger to give
    aiohttp, at debug and trace unless --disable-uvicorn-access-log (None: no access
    lines)."""
    if server.uvicorn_log_level != "info":
        logging.getLogger().setLevel(LOG_LEVELS[server.uvicorn_log_level])
    if not server.logs_requests:
        logging.getLogger(REQUEST_LOGGER).setLevel(logging.WARNING)
    if server.disable_uvicorn_access_log or LOG_LEVELS[server.uvicorn_log_level] > logging.DEBUG:
        return None
    return logging.getLogger(ACCESS_LOGGER)

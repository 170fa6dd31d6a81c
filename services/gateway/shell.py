"""The gateway process: the HTTP API in front of the pipeline. It loads the tokenizer (for
/tokenize, /detokenize and echo), never the weights; publishes requests to hr:requests;
reads its own reply stream; and watches the scheduler's liveness key and the queue depth
a few times a second, for admission and so that no request outlives the scheduler."""

from __future__ import annotations

import os
import secrets
import socket
import time

import anyio
from aiohttp import web
from redis.exceptions import RedisError

from common.log import get_logger
from common.model_info import load_model_info
from common.service import ServiceContext, freeze_heap, run_service
from services.gateway.app import Gateway
from services.gateway.core import scheduler_gone

WATCH_S = 0.25
TRIM_EVERY_S = 5.0
SHUTDOWN_S = 2.0  # in-flight calls get this long to finish on SIGTERM, then are aborted

log = get_logger(__name__)


async def watch_backend(gateway: Gateway) -> None:
    """Never raises: a background task that died would take every open stream with it."""
    next_trim = time.monotonic() + TRIM_EVERY_S
    while True:
        await gateway.refresh_backend()
        now = time.monotonic()
        if not gateway.backend.alive(now):
            gateway.replies.fail_all(scheduler_gone)
        if now >= next_trim:
            next_trim = now + TRIM_EVERY_S
            try:
                await gateway.replies.trim()
            except RedisError as e:  # trimmed next time
                log.warning("cannot trim the reply stream", error=str(e))
        await anyio.sleep(WATCH_S)


async def serve(ctx: ServiceContext) -> None:
    info = await anyio.to_thread.run_sync(load_model_info, ctx.engine)
    # unique across hosts and restarts: a restarted gateway must not read its
    # predecessor's replies
    gateway_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    gateway = Gateway(ctx.bus, ctx.server, info, ctx.engine.model, gateway_id)
    await gateway.refresh_backend()
    freeze_heap()
    runner = web.AppRunner(gateway.app(), handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_S, access_log=None)
    await runner.setup()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(gateway.replies.run)
        tasks.start_soon(gateway.outbox.run)
        tasks.start_soon(watch_backend, gateway)
        try:
            # several gateways share one port only when asked to: otherwise a second
            # server started on a busy port fails instead of silently splitting its clients
            await web.TCPSite(runner, ctx.server.host, ctx.server.port,
                              reuse_port=ctx.server.api_server_count > 1).start()
            log.info("gateway listening", url=f"http://{ctx.server.host}:{ctx.server.port}",
                     gateway=gateway_id, models=gateway.names)
            await ctx.stop.wait()
        finally:
            with anyio.CancelScope(shield=True):  # replies still flow while calls finish
                await runner.cleanup()
                await gateway.finish_tasks(SHUTDOWN_S)
                await gateway.replies.delete()
            tasks.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    return run_service("gateway", argv, serve, __doc__ or "")

"""The gateway process: the HTTP API in front of the pipeline. It loads the tokenizer (for
/tokenize, /detokenize and echo), never the weights; publishes requests to hr:requests;
reads its own reply stream; and watches the scheduler's liveness key and the queue depth
a few times a second, for admission and so that no request outlives its shard's
scheduler."""

from __future__ import annotations

import os
import secrets
import socket
import time

import anyio
from aiohttp import web
from redis.exceptions import RedisError

from common import keys
from common.bus import Bus
from common.log import get_logger
from common.model_info import load_model_info
from common.service import ServiceContext, freeze_heap, heartbeat, run_service
from services.gateway.app import Gateway
from services.gateway.http_options import apply_log_levels, tls_context
from services.gateway.core import dead_reply_streams, load_failed, load_failure

WATCH_S = 0.25
TRIM_EVERY_S = 5.0
DEAD_REPLIES_IDLE_S = 60.0
SHUTDOWN_S = 2.0  # after the drain, what aiohttp gives handlers still running
# connects the kernel holds until the loop accepts them (the kernel caps it at somaxconn).
# aiohttp's 128 dropped part of a burst of thousands of clients on a busy 2-core host:
# their request sat unanswered for a minute and ended in a reset. uvicorn's is 2048.
LISTEN_BACKLOG = 4096

log = get_logger(__name__)


async def watch_backend(gateway: Gateway) -> None:
    """Never raises: a background task that died would take every open stream with it."""
    next_trim = time.monotonic() + TRIM_EVERY_S
    while True:
        before = gateway.backend
        await gateway.refresh_backend()
        now = time.monotonic()
        if (down := gateway.backend.why_down(now)) is not None:
            gateway.replies.fail_all(down)
        elif (failure := load_failure(gateway.backend.shards)) is not None:
            gateway.replies.fail_all(load_failed(*failure))  # no worker will serve them
        else:
            for shard, error_for in gateway.backend.lost_shards(before):
                gateway.replies.fail_shard(shard, error_for)
        if now >= next_trim:
            next_trim = now + TRIM_EVERY_S
            try:
                await gateway.replies.trim()
                await forget_dead_gateways(gateway.bus)
            except RedisError as e:  # done next time
                log.warning("cannot trim the reply streams", error=str(e))
        await anyio.sleep(WATCH_S)


async def forget_dead_gateways(bus: Bus) -> None:
    infos = await bus.stream_infos(keys.replies("*"))
    ids = [info.name.removeprefix(keys.replies("")) for info in infos]
    alive = await bus.values(*map(keys.alive_gateway, ids)) if ids else []
    if dead := dead_reply_streams(infos, alive, time.time() * 1000,
                                  DEAD_REPLIES_IDLE_S * 1000):
        log.info("deleting the reply streams of gateways gone", streams=dead)
        await bus.forget(*dead)


async def serve(ctx: ServiceContext) -> None:
    info = await anyio.to_thread.run_sync(load_model_info, ctx.engine, True)  # torch_free
    # unique across hosts and restarts: a restarted gateway must not read its
    # predecessor's replies
    gateway_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    gateway = Gateway(ctx.bus, ctx.server, info, ctx.engine.model, gateway_id)
    if gateway.adapters is not None:
        await gateway.adapters.register(ctx.engine.loras(), gateway.names)
    await gateway.refresh_backend()
    freeze_heap()
    # the keep-alive timer also runs from a connection's start until its first request's
    # headers are complete: a client that trickles them (or sends none) is cut off
    access_log = apply_log_levels(ctx.server)
    runner = web.AppRunner(gateway.app(), handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_S, access_log=access_log,
                           keepalive_timeout=ctx.server.timeout_keep_alive)
    await runner.setup()
    drained = anyio.Event()  # the liveness key outlives the drain: the calls still run
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(gateway.replies.run)
        tasks.start_soon(gateway.outbox.run)
        tasks.start_soon(watch_backend, gateway)
        tasks.start_soon(heartbeat, ctx.bus, keys.alive_gateway(gateway_id), gateway_id,
                         drained)
        try:
            # several gateways share one port only when asked to: otherwise a second
            # server started on a busy port fails instead of silently splitting its clients
            server = ctx.server
            await web.TCPSite(runner, server.host, server.port,
                              reuse_port=(server.api_server_count or 1) > 1,
                              backlog=LISTEN_BACKLOG, ssl_context=tls_context(server)).start()
            log.info("gateway listening",
                     url=f"{server.scheme}://{server.host}:{server.port}"
                         f"{server.root_path or ''}",
                     gateway=gateway_id, models=gateway.names,
                     allowed_origins=server.allowed_origins,
                     log_requests=server.logs_requests,
                     log_level=server.uvicorn_log_level)
            await ctx.stop.wait()
            await gateway.drain(ctx.server.shutdown_timeout)
        finally:
            with anyio.CancelScope(shield=True):  # replies still flow while calls finish
                await runner.cleanup()
                await gateway.finish_tasks(SHUTDOWN_S)
                await gateway.replies.delete()
                drained.set()
            tasks.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    return run_service("gateway", argv, serve, __doc__ or "")

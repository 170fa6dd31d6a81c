"""A consumer process for the bus tests: reads Abort messages from one stream and answers
each with an ErrorReply on another whose `message` names the consumer that handled it.

    python tests/bus_worker.py URL IN OUT GROUP CONSUMER [--delay-ms N] [--min-idle-ms N]
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.bus import Bus  # noqa: E402
from common.log import configure_logging  # noqa: E402
from common.messages import Abort, ErrorReply  # noqa: E402


async def serve(args: argparse.Namespace) -> None:
    stop = anyio.Event()

    async def handle(msg: Abort) -> list[tuple[str, ErrorReply]]:
        await anyio.sleep(args.delay_ms / 1000)
        return [(args.out_stream, ErrorReply(msg.rid, 200, args.consumer))]

    async def stop_on_sigterm() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                stop.set()
                return

    async with Bus(args.url) as bus, anyio.create_task_group() as tasks:
        tasks.start_soon(stop_on_sigterm)
        print("ready", flush=True)
        await bus.consume(args.in_stream, args.group, args.consumer, handle, count=4,
                          block_ms=200, stop=stop, min_idle_ms=args.min_idle_ms,
                          reclaim_every_s=0.2)
        tasks.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("url", "in_stream", "out_stream", "group", "consumer"):
        parser.add_argument(name)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--min-idle-ms", type=int, default=1000)
    args = parser.parse_args()
    configure_logging("bus_worker", args.consumer)
    anyio.run(serve, args)


if __name__ == "__main__":
    main()

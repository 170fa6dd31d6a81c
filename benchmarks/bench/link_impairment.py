"""Packet loss and latency on a link, made in user space: a forwarder between two network
interfaces that copies every Ethernet frame received on one out of the other, each frame
held `delay_ms` and `loss_pct` percent of them dropped, each way on its own.

It exists for kernels built without sch_netem (`tc qdisc add ... netem` says "Specified
qdisc kind is unknown"), where benchmarks/bench/hosts.py splices it into a host's link:

    python -m benchmarks.bench.link_impairment IFACE_A IFACE_B --loss-pct 10 --delay-ms 200

What it models: a fixed one-way delay, i.i.d. loss per frame, at most QUEUE_LIMIT frames
held (netem's default limit at each end). What it does not: jitter, reordering, correlated
or burst loss, duplication, corruption, a rate limit. A frame the kernel hands over as one
segmentation-offload super-frame (up to 64 KiB of TCP) is delayed or lost as one, as under
netem. It stops, closing its sockets, on SIGTERM. Needs root (CAP_NET_RAW)."""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
PACKET_VNET_HDR = 15
FRAME_BYTES = 65536 + 64  # a 64 KiB offload super-frame, its virtio_net_hdr and header
SO_RCVBUFFORCE = 33  # SO_RCVBUF past net.core.rmem_max, for root
RECEIVE_BUFFER_BYTES = 8 << 20
QUEUE_LIMIT = 2000  # frames held at once, both ways: netem's default `limit` at each end
READY = b"forwarding\n"  # said on stdout once both sockets are open
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Impairment:
    loss_pct: float = 10.0
    delay_ms: float = 200.0


def why_no_packet_sockets() -> str | None:
    """None when this process may open AF_PACKET raw sockets; else why not."""
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0).close()
    except OSError as e:
        return f"no AF_PACKET raw socket: {e}"
    return None


def open_port(iface: str) -> socket.socket:
    """A raw socket that sees every frame on `iface` and sends frames out of it."""
    # Protocol 0 until bound: a socket made for ETH_P_ALL hears every interface at once.
    port = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    # The offload header (GSO, checksum left to the device) comes in with each frame and
    # goes out with it: a local TCP's frames leave their checksums for the device to fill.
    port.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    # Room for a burst of super-frames while this process waits for a CPU: the default
    # (about 200 KiB, three of them) would overflow, a loss nobody asked for.
    port.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER_BYTES)
    port.bind((iface, ETH_P_ALL))
    # Promiscuous while the socket is open (the kernel undoes it when it closes): the frames
    # carry the MACs of the namespaces at either end, not this interface's.
    membership = struct.pack("iHH8s", socket.if_nametoindex(iface), PACKET_MR_PROMISC, 0,
                             b"")
    port.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, membership)
    port.setblocking(False)
    return port


def received(port: socket.socket) -> bytes | None:
    """The next frame that came in on `port`'s interface: not one going out of it (our own
    writes included), which would loop."""
    try:
        frame, address = port.recvfrom(FRAME_BYTES)
    except BlockingIOError:
        return None
    return None if address[2] == socket.PACKET_OUTGOING else frame


def send(port: socket.socket, frame: bytes) -> None:
    try:
        port.send(frame)
    except OSError:  # a full queue or an interface going down: lost, as on a wire
        pass


def forward(a: str, b: str, impairment: Impairment) -> None:
    """Frames from a to b and from b to a, each held delay_ms or dropped, until killed."""
    drop, delay_s = impairment.loss_pct / 100, impairment.delay_ms / 1000
    rng = random.Random()
    order = itertools.count()  # ties in release time go out in arrival order
    held: list[tuple[float, int, socket.socket, bytes]] = []  # (release at, n, out, frame)
    with open_port(a) as port_a, open_port(b) as port_b, selectors.DefaultSelector() as sel:
        sel.register(port_a, selectors.EVENT_READ, (port_a, port_b))  # (in, out)
        sel.register(port_b, selectors.EVENT_READ, (port_b, port_a))
        sys.stdout.buffer.write(READY)
        sys.stdout.flush()
        while True:
            wait_s = max(0.0, held[0][0] - time.monotonic()) if held else None
            for key, _ in sel.select(wait_s):
                incoming, out = key.data
                frame = received(incoming)
                if frame is None or rng.random() < drop or len(held) >= QUEUE_LIMIT:
                    continue
                heapq.heappush(held, (time.monotonic() + delay_s, next(order), out, frame))
            while held and held[0][0] <= time.monotonic():
                _, _, out, frame = heapq.heappop(held)
                send(out, frame)


def start_forwarder(a: str, b: str, impairment: Impairment, log: Path
                    ) -> subprocess.Popen[bytes]:
    """The forwarder as its own process (killed with this one), once it forwards."""
    from common.redis_server import spawn_child  # here: the forwarder needs no Redis client
    argv = [sys.executable, "-m", "benchmarks.bench.link_impairment", a, b,
            "--loss-pct", f"{impairment.loss_pct:g}", "--delay-ms", f"{impairment.delay_ms:g}"]
    with log.open("ab") as errors:
        process = spawn_child(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=errors)
    assert process.stdout is not None
    if process.stdout.readline() != READY:  # it died first: its traceback is in the log
        raise RuntimeError(f"the forwarder between {a} and {b} exited with "
                           f"{process.wait(STOP_TIMEOUT_S)}: see {log}")
    return process


def stop_forwarder(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("iface_a")
    parser.add_argument("iface_b")
    parser.add_argument("--loss-pct", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=200.0)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds: the sockets close
    forward(args.iface_a, args.iface_b, Impairment(args.loss_pct, args.delay_ms))


if __name__ == "__main__":
    main()

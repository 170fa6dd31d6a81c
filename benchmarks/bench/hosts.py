"""Hosts simulated on one Linux machine: each a network namespace with its own address on
a bridge, running one `headrace serve` (its gateway, tokenizer, detokenizer and one
data-parallel shard's scheduler and worker) against a Redis Cluster that listens on the
bridge's address in the root namespace. Needs root (or CAP_NET_ADMIN) and `ip`/`tc`.
degrade_link uses netem where the kernel has it, else a user-space forwarder spliced into
the link (benchmarks/bench/link_impairment.py).

    with SimulatedHosts(run_dir, model, hosts=2) as hosts:
        hosts.start_all(); hosts.wait_healthy()
        hosts.cut_link(1); ...; hosts.restore_link(1)
        hosts.kill_host(1); hosts.start(1)
        hosts.degrade_link(1, loss_pct=10, delay_ms=200); hosts.heal_link(1)

Every name (bridge, links, namespaces) carries this process's pid, so runs side by side do
not meet, and clean-up removes only its own: the processes first, then the namespaces
(which take their end of each link), then the bridge."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import psutil

from benchmarks.bench.link_impairment import (Impairment, start_forwarder, stop_forwarder,
                                              why_no_packet_sockets)
from benchmarks.bench.redis_cluster import LocalCluster
from benchmarks.bench.redis_nodes import start_or_stop
from common.redis_server import spawn_child

REPO = Path(__file__).resolve().parents[2]
GATEWAY_PORT = 8000
STOP_TIMEOUT_S = 30.0


class HostsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no `ip`, a container)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def _tc(namespace: str | None, *args: str) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    subprocess.run([*prefix, "tc", *args], capture_output=True, text=True, check=True,
                   timeout=30)


def why_no_namespaces() -> str | None:
    """None when this process may make namespaces, bridges and veth pairs; else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    name = f"hrchk{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@functools.cache  # the kernel's qdiscs do not change while this process runs
def why_no_netem() -> str | None:
    """None when `tc qdisc ... netem` works here; else why not (a kernel built without
    CONFIG_NET_SCH_NETEM says "Specified qdisc kind is unknown")."""
    if (reason := why_no_namespaces()) is not None:
        return reason
    link = f"hrn{os.getpid()}"
    _ip("link", "add", link, "type", "veth", "peer", "name", f"hrm{os.getpid()}")
    try:
        tried = subprocess.run(["tc", "qdisc", "add", "dev", link, "root", "netem", "delay",
                                "1ms"], capture_output=True, text=True, timeout=30)
    finally:
        _ip("link", "del", link, check=False)
    if tried.returncode != 0:
        return f"`tc qdisc add ... netem` failed: {tried.stderr.strip()}"
    return None


def link_impairment_kind() -> str:
    """How degrade_link impairs a link here: "netem" where the kernel has it (the first
    choice: no process in the path to be scheduled), else "forwarder"."""
    return "netem" if why_no_netem() is None else "forwarder"


def why_no_link_impairment() -> str | None:
    """None when degrade_link works here, by netem or else by the forwarder (which needs
    root, namespaces and AF_PACKET sockets); else why not."""
    if why_no_netem() is None:
        return None
    return why_no_namespaces() or why_no_packet_sockets()


@dataclass(slots=True)
class Host:
    index: int
    namespace: str
    link: str  # the root namespace's end of its veth pair, on the bridge
    peer: str  # the end inside the namespace
    address: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    forwarder: subprocess.Popen[bytes] | None = None  # while degraded, where no netem

    @property
    def url(self) -> str:
        return f"http://{self.address}:{GATEWAY_PORT}"


@dataclass(slots=True)
class SimulatedHosts:
    run_dir: Path
    model: str
    hosts: int = 2
    serve_args: list[str] = field(default_factory=list)  # more `headrace serve` flags
    env: dict[str, str] = field(default_factory=dict)
    cluster_replicas: int = 0
    tag: str = field(default_factory=lambda: str(os.getpid()))
    members: list[Host] = field(default_factory=list)
    cluster: LocalCluster | None = None
    _made: list[tuple[str, ...]] = field(default_factory=list)  # `ip` objects to delete

    # --- the network ---------------------------------------------------------------------

    @property
    def subnet(self) -> str:
        """10.X.Y.0/24 from the pid: unique among the runs on this machine."""
        pid = int(self.tag)
        return f"10.{(pid >> 8) % 256}.{pid % 256}"

    @property
    def bridge(self) -> str:
        return f"hrb{self.tag}"

    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.1"

    @property
    def bridge_mac(self) -> str:
        """A locally administered MAC from the pid. Set, it stays: a bridge left to itself
        takes its lowest port's, which changes when degrade_link swaps a port, and every
        host's ARP entry for the bridge's address would point nowhere."""
        pid = int(self.tag)
        return "02:68:72:" + ":".join(f"{(pid >> shift) % 256:02x}" for shift in (16, 8, 0))

    def __enter__(self) -> SimulatedHosts:
        start_or_stop(self.make_network_and_cluster, self.close)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def make_network_and_cluster(self) -> None:
        self.make_network()
        self.cluster = LocalCluster(self.run_dir / "cluster", host=self.bridge_address,
                                    replicas=self.cluster_replicas,
                                    node_timeout_ms=1000 if self.cluster_replicas else 15_000)
        self.cluster.__enter__()

    def make_network(self) -> None:
        if (reason := why_no_namespaces()) is not None:
            raise HostsUnavailable(reason)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _ip("link", "add", self.bridge, "address", self.bridge_mac, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.hosts):
            host = Host(i, f"hr{self.tag}h{i}", f"hrv{self.tag}h{i}", f"hrp{self.tag}h{i}",
                        f"{self.subnet}.{10 + i}", self.run_dir / f"host{i}.log")
            _ip("netns", "add", host.namespace)
            self._made.insert(0, ("netns", "del", host.namespace))
            _ip("link", "add", host.link, "type", "veth", "peer", "name", host.peer)
            self._made.insert(0, ("link", "del", host.link))
            _ip("link", "set", host.link, "master", self.bridge, "up")
            _ip("link", "set", host.peer, "netns", host.namespace)
            inside = ("netns", "exec", host.namespace, "ip")
            _ip(*inside, "addr", "add", f"{host.address}/24", "dev", host.peer)
            _ip(*inside, "link", "set", host.peer, "up")
            _ip(*inside, "link", "set", "lo", "up")
            self.members.append(host)

    def close(self) -> None:
        """Everything this object made, whatever state it is in; never raises."""
        for host in self.members:
            self.unsplice_forwarder(host.index)
            self.kill_host(host.index)
        if self.cluster is not None:
            self.cluster.stop()
        for command in self._made:  # namespaces first: their end of each link goes too
            _ip(*command, check=False)
        self._made = []

    # --- the processes ---------------------------------------------------------------------

    def serve_command(self, host: Host) -> list[str]:
        assert self.cluster is not None
        return ["ip", "netns", "exec", host.namespace,
                sys.executable, "-m", "services.cli", "serve", self.model,
                "--device", "cpu", "--redis-url", self.cluster.url,
                "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
                "--data-parallel-size", str(self.hosts),
                "--data-parallel-start-rank", str(host.index),
                "--data-parallel-size-local", "1",
                "--api-server-count", "1", "--tokenizer-replicas", "1",
                "--detokenizer-replicas", "1",
                "--run-dir", str(self.run_dir / f"run{host.index}"), *self.serve_args]

    def start(self, i: int) -> None:
        """Host i's `headrace serve` (it restarts its own children that exit)."""
        host = self.members[i]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **self.env)
        with host.log_path.open("ab") as log:
            host.process = spawn_child(self.serve_command(host), cwd=REPO, env=env,
                                       stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)

    def start_all(self) -> None:
        for i in range(self.hosts):
            self.start(i)

    def processes(self, i: int) -> list[psutil.Process]:
        """Every process in host i's namespace (`ip netns pids`)."""
        found = _ip("netns", "pids", self.members[i].namespace, check=False).stdout.split()
        processes = []
        for pid in found:
            try:
                processes.append(psutil.Process(int(pid)))
            except psutil.Error:
                continue
        return processes

    def kill_host(self, i: int) -> None:
        """SIGKILL to every process of host i, as when it loses power."""
        for process in self.processes(i):
            try:
                process.kill()
            except psutil.Error:
                continue
        host = self.members[i]
        if host.process is not None:
            try:
                host.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # stuck in the kernel: not ours to wait on
                pass
            host.process = None
        psutil.wait_procs(self.processes(i), timeout=STOP_TIMEOUT_S)

    def stop_host(self, i: int) -> None:
        """SIGTERM to host i's launcher, which stops its children; SIGKILL what is left."""
        host = self.members[i]
        if host.process is not None and host.process.poll() is None:
            host.process.send_signal(signal.SIGTERM)
            try:
                host.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        self.kill_host(i)

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(self.members[i].url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float = 300.0, which: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(range(self.hosts)) if which is None else list(which)
        while waiting:
            waiting = [i for i in waiting if not self.healthy(i)]
            for i in waiting:
                process = self.members[i].process
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"host {i}'s serve exited with {process.returncode}:"
                                       f"\n{self.log_tail(i)}")
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"hosts {waiting} not healthy in {timeout_s:g}s:\n"
                                   + "\n".join(self.log_tail(i) for i in waiting))
            time.sleep(0.5)

    def log_tail(self, i: int, lines: int = 40) -> str:
        path = self.members[i].log_path
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- host {i} ---\n" + "\n".join(text.splitlines()[-lines:])

    # --- the faults ------------------------------------------------------------------------

    def cut_link(self, i: int) -> None:
        """Host i's cable pulled: its link on the bridge goes down (nothing in or out)."""
        _ip("link", "set", self.members[i].link, "down")

    def restore_link(self, i: int) -> None:
        _ip("link", "set", self.members[i].link, "up")

    def degrade_link(self, i: int, loss_pct: float = 10.0, delay_ms: int = 200) -> None:
        """Packet loss and latency on host i's link, each way: netem on both ends where the
        kernel has it, else the forwarder spliced into the link."""
        if link_impairment_kind() == "forwarder":
            self.splice_forwarder(i, Impairment(loss_pct, delay_ms))
            return
        host = self.members[i]
        netem = ("netem", "loss", f"{loss_pct:g}%", "delay", f"{delay_ms}ms")
        _tc(None, "qdisc", "add", "dev", host.link, "root", *netem)
        _tc(host.namespace, "qdisc", "add", "dev", host.peer, "root", *netem)

    def heal_link(self, i: int) -> None:
        """Host i's link as before degrade_link; nothing to do where it is not degraded."""
        if link_impairment_kind() == "forwarder":
            self.unsplice_forwarder(i)
            return
        host = self.members[i]
        for namespace, dev in ((None, host.link), (host.namespace, host.peer)):
            try:
                _tc(namespace, "qdisc", "del", "dev", dev, "root")
            except subprocess.CalledProcessError:  # none there
                pass

    def splice_links(self, i: int) -> tuple[str, str, str]:
        """What splice_forwarder adds for host i: a veth pair (its end on the bridge, the
        forwarder's end) and a bridge kept down that holds the forwarder's two ends."""
        return f"hri{self.tag}h{i}", f"hrj{self.tag}h{i}", f"hrw{self.tag}h{i}"

    def splice_forwarder(self, i: int, impairment: Impairment) -> None:
        """Host i's link off the bridge, joined to it again through the forwarder and a new
        veth pair: the same frames, MACs and addresses end to end, so connections live on.
        The forwarder's ends sit on a bridge kept down, which drops each frame they receive
        once the forwarder has read it: unbridged, this namespace's stack would take them,
        and answer a host's ARP for the bridge's address past the delay."""
        host, (on_bridge, forwarder_end, hold) = self.members[i], self.splice_links(i)
        _ip("link", "add", hold, "type", "bridge")
        _ip("link", "add", on_bridge, "type", "veth", "peer", "name", forwarder_end)
        _ip("link", "set", forwarder_end, "master", hold, "up")
        host.forwarder = start_forwarder(host.link, forwarder_end, impairment,
                                         self.run_dir / f"forwarder{i}.log")
        _ip("link", "set", host.link, "master", hold)  # off the bridge: through the forwarder
        _ip("link", "set", on_bridge, "master", self.bridge, "up")

    def unsplice_forwarder(self, i: int) -> None:
        """The forwarder stopped, host i's link back on the bridge and what splice_forwarder
        added deleted; safe where nothing is spliced."""
        host, (on_bridge, _, hold) = self.members[i], self.splice_links(i)
        if host.forwarder is not None:
            stop_forwarder(host.forwarder)
            host.forwarder = None
        _ip("link", "set", host.link, "master", self.bridge, check=False)
        _ip("link", "del", on_bridge, check=False)  # its peer, the forwarder's end, goes too
        _ip("link", "del", hold, check=False)

"""A real multi-node Ray cluster on one host: a head and worker nodes started with `ray start`
(issue 13 item 1), each its own raylet with its own ports, CPUs and a custom resource naming it,
so that STRICT_SPREAD placement really puts ranks on different nodes.

Everything lives under one short temp dir (`--temp-dir`), and every process this cluster
started is found by that dir in its command line and stopped by its pid: `ray stop` would stop
every Ray on the machine, other people's included. Token auth is off (a throwaway cluster). Every node and the driver are
given `--node-ip-address 127.0.0.1`; Ray 2.60 on Linux replaces that with the host's own
address (services.resolve_ip_for_localhost), which the kernel routes locally: the traffic
never leaves the host either way."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Node loss is noticed by GCS health checks (default: 5 misses 3 s apart); a test waits less.
HEALTH_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
              "RAY_health_check_initial_delay_ms": "500", "RAY_health_check_timeout_ms": "1000"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str  # also its custom resource: {"<name>": 1}
    node_manager_port: int
    head: bool = False
    node_id: str | None = None  # Ray's hex id, once the node has registered


class LocalCluster:
    def __init__(self) -> None:
        # Short: Ray's unix socket paths live under it (limit ~107 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="twc", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, Node] = {}
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", **HEALTH_ENV}

    def _ray(self) -> str:
        return str(Path(sys.executable).with_name("ray"))

    def start_nodes(self, cpus: dict[str, int], timeout_s: float = 120, tries: int = 3) -> None:
        """Start worker nodes one after the other: `ray start` picks some ports itself (free
        when it looks), so two started at once can pick the same one and a raylet aborts on
        "bind: Address already in use". A node whose start failed so (another process on the
        machine can take a port too) is started again with new ports, up to `tries` times."""
        for name, n in cpus.items():
            for attempt in range(tries):
                try:
                    self._check(*self._launch(name, n, head=False), timeout_s)
                    break
                except RuntimeError:
                    if attempt == tries - 1:
                        raise

    def start_node(self, name: str, num_cpus: int, head: bool = False, timeout_s: float = 120) -> Node:
        node, proc = self._launch(name, num_cpus, head)
        return self._check(node, proc, timeout_s)

    def _check(self, node: Node, proc: subprocess.Popen, timeout_s: float) -> Node:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0:
            # `ray start` gives a raylet 30 s (hard-coded) to register; on a loaded machine it
            # may register later. A raylet that is up will be waited for by wait_nodes().
            self.nodes[node.name] = node
            try:
                self.raylet_pid(node.name)
            except RuntimeError:
                del self.nodes[node.name]
                raise RuntimeError(f"ray start for node {node.name} failed ({proc.returncode}):\n{out}\n{err[-2000:]}\n"
                                   f"raylet logs:\n{self._raylet_errors()}") from None
        self.nodes[node.name] = node
        return node

    def _launch(self, name: str, num_cpus: int, head: bool) -> tuple[Node, subprocess.Popen]:
        node = Node(name, free_port(), head)
        args = [self._ray(), "start", "--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus),
                "--resources", json.dumps({name: 1}), "--temp-dir", str(self.temp_dir),
                "--node-manager-port", str(node.node_manager_port), "--object-manager-port", str(free_port()),
                "--metrics-export-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
                "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats"]
        if head:
            args += ["--head", "--port", str(self.port), "--include-dashboard", "false",
                     "--ray-client-server-port", str(free_port())]
        else:
            args += ["--address", self.address]
        return node, subprocess.Popen(args, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def _raylet_errors(self) -> str:
        lines = []
        for f in sorted(self.temp_dir.glob("session_*/logs/raylet*.out")):
            lines += [f"{f.name}: {ln}" for ln in f.read_text(errors="replace").splitlines()
                      if " E " in ln or " F " in ln or "Check failed" in ln][:5]
        return "\n".join(lines[-20:])

    def wait_nodes(self, names: list[str], timeout_s: float = 60) -> None:
        """Wait until the driver sees these nodes alive; note their node ids."""
        import ray

        deadline = time.monotonic() + timeout_s
        while True:
            nodes = [n for n in ray.nodes() if n["Alive"]]
            alive = {k: n["NodeID"] for n in nodes for k in n["Resources"] if k in self.nodes}
            self.addresses = {k: n["NodeManagerAddress"] for n in nodes for k in n["Resources"] if k in self.nodes}
            if all(name in alive for name in names):
                for name in names:
                    self.nodes[name].node_id = alive[name]
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {names} not alive after {timeout_s}s; alive: {sorted(alive)}")
            time.sleep(0.5)

    def pids(self, needle: str | None = None) -> list[int]:
        """Pids of this cluster's processes (and only those): their command line names our temp
        dir (or, for worker processes, a session under it); `needle` narrows further."""
        out = []
        tag = str(self.temp_dir)
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if tag in cmd and (needle is None or needle in cmd) and int(d.name) != os.getpid():
                out.append(int(d.name))
        return out

    def raylet_pid(self, name: str) -> int:
        port = self.nodes[name].node_manager_port
        pids = [p for p in self.pids(f"--node_manager_port={port}") if "raylet" in _exe(p)]
        if len(pids) != 1:
            raise RuntimeError(f"expected one raylet for node {name} (port {port}), found {pids}")
        return pids[0]

    def kill_node(self, name: str) -> list[int]:
        """A lost machine: SIGKILL the node's raylet and every process it started (its workers,
        our ranks among them, and its agents), all at once. A raylet killed alone leaves its
        workers running: the actors answer direct calls and the "lost" node keeps training.
        Returns the pids killed."""
        raylet = self.raylet_pid(name)
        pids = [raylet] + _descendants(raylet)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        """Stop every process of this cluster by pid (TERM, then KILL), then remove the temp dir."""
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def is_local_address(addr: str) -> bool:
    """True if `addr` belongs to this host (a socket can bind to it)."""
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False

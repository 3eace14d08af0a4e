"""A real two-node Ray cluster on this machine: train ranks share one node, the engine gets the other.

Both nodes are `ray start --block` processes in their own sessions and temp dir, stopped by killing
those process groups: `ray stop` would stop every Ray instance on the machine, not only ours.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from miles.ray.cluster import bind_host, init_ray
from miles.ray.placement import create_placement, plan_placement, remove_placement

START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _descendants(roots: list[int]) -> set[int]:
    """`roots` and every live process below them (Ray renames some children, so walk the tree)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        # The command name in (parentheses) may contain spaces; the parent pid follows it.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid for pid in roots if Path(f"/proc/{pid}").exists()]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has exited; only its parent's wait is missing
            alive.add(pid)
    return alive


def _wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.5)


class _LocalCluster:
    """A head (2 CPUs) and a worker (1 CPU) node, each a `ray start --block` process group."""

    def __init__(self) -> None:
        # Short path: Ray puts Unix sockets under it, and those paths are limited to ~107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="miles-ray-", dir="/tmp")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # RAY_TMPDIR keeps even the "current cluster" file in our dir, so no other Ray user on this
        # machine auto-joins our cluster. The nodes take this process's token-auth mode: a local
        # ray.init earlier in the session turns it on here, and a mismatch makes actors fail.
        self.env = dict(
            os.environ,
            RAY_TMPDIR=self.temp_dir,
            RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"),
            RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # stop at once on SIGTERM, no draining
        )
        self.processes: list[subprocess.Popen] = []

    def _start_node(self, name: str, *args: str) -> None:
        ray_cli = Path(sys.executable).with_name("ray")
        # Port 0 lets each node pick free ports, so two nodes (and other users) never collide.
        command = [
            str(ray_cli), "start", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}",
            f"--object-store-memory={128 * 1024**2}",
            "--node-manager-port=0", "--object-manager-port=0",
            "--min-worker-port=0", "--max-worker-port=0", "--dashboard-agent-listen-port=0",
            *args,
        ]  # fmt: skip
        # A new session per node, so stopping it is one killpg that reaches nothing of anyone else's.
        with open(Path(self.temp_dir) / f"{name}.log", "wb") as log:
            process = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.processes.append(process)

    def start(self) -> None:
        self._start_node(
            "head", "--head", f"--port={self.port}", "--num-cpus=2",
            "--include-dashboard=false", f"--dashboard-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
        )  # fmt: skip
        # The head writes the cluster address file once its GCS and raylet are up.
        address_file = Path(self.temp_dir) / "ray_current_cluster"
        head = self.processes[0]
        _wait_until(
            lambda: address_file.exists() or head.poll() is not None,
            START_TIMEOUT_S,
            f"the head node ({self.logs()})",
        )
        if head.poll() is not None:
            raise RuntimeError(f"the head node exited with {head.returncode}; {self.logs()}")
        self._start_node("worker", f"--address={self.address}", "--num-cpus=1")

    def logs(self) -> str:
        return f"logs in {self.temp_dir}"

    def stop(self) -> set[int]:
        """Stop both nodes and everything they started; return the PIDs that outlived the stop
        and had to be killed (none, when Ray shuts down cleanly)."""
        ours = _descendants([process.pid for process in self.processes])
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        # Ray workers sit in their own process groups and exit shortly after their raylet.
        try:
            _wait_until(lambda: not _alive(ours), 20, "the nodes' processes to exit")
        except TimeoutError:
            stragglers = _alive(ours)
            for pid in stragglers:
                os.kill(pid, signal.SIGKILL)
            return stragglers
        return set()


@pytest.fixture
def two_node_cluster() -> Iterator[_LocalCluster]:
    if ray.is_initialized():
        pytest.fail("this process is already connected to Ray; the test must join its own cluster")
    cluster = _LocalCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        ray.shutdown()
        stragglers = cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
        assert not stragglers, f"ray processes outlived their node's stop: {stragglers}"


@ray.remote
class _Probe:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_disaggregated_trainers_share_a_node_and_the_engine_gets_the_other(
    two_node_cluster, monkeypatch
):
    # Joining through $RAY_ADDRESS, as on a real cluster; num_cpus is the nodes' business there.
    monkeypatch.setenv("RAY_ADDRESS", two_node_cluster.address)
    init_ray(num_cpus=64, log_to_driver=False)
    _wait_until(
        lambda: sum(node["Alive"] for node in ray.nodes()) == 2,
        START_TIMEOUT_S,
        f"the worker node to join ({two_node_cluster.logs()})",
    )
    cpus = {node["NodeID"]: node["Resources"]["CPU"] for node in ray.nodes() if node["Alive"]}
    plan = plan_placement(
        actor_num_nodes=1,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        colocate=False,
        use_gpus=False,
    )
    placement = create_placement(plan, timeout_s=60)
    try:
        strategies = [placement.actor_scheduling(0), placement.actor_scheduling(1)]
        strategies.append(placement.engine_scheduling(0))
        # One whole-bundle probe per bundle, alive together: each runs only in its own bundle.
        probes = [_Probe.options(num_cpus=1, scheduling_strategy=s).remote() for s in strategies]
        trainer0, trainer1, engine = ray.get([p.node.remote() for p in probes], timeout=60)
    finally:
        remove_placement(placement)
    assert trainer0 == trainer1, "train ranks should fill one node before using another"
    assert engine != trainer0
    assert cpus[trainer0] == 2 and cpus[engine] == 1
    assert ray.cluster_resources()["CPU"] == 3
    assert placement.bundle_nodes == [trainer0, trainer1, engine]
    # Several nodes: every process binds its own node's address, where the others reach it.
    assert bind_host() is None

"""Two Ray nodes on one machine, as on a cluster: `ray start --head` plus `ray start --address`.

Every node has a CPU, but only the worker nodes have the custom resource `ftc_worker_node`, and the
worker actors ask for it (FTC_ACTOR_RESOURCES), so they run on a worker node and never on the head.
`ftc worker` joins the cluster through RAY_ADDRESS, as a Ray job does. The worker node is killed
mid-job (every process it runs, at once, as when a machine dies); a fresh worker node
joins, the supervisor's replacement actor lands there, and the job resumes from its checkpoints and
succeeds: nothing computed before the kill is lost or computed again.

Slow (three to five minutes on two busy cores: three Ray nodes, two actors importing torch, a lease
to run out): run with `pytest --run-slow`. On a heavily overloaded machine Ray's own start-up calls
can time out; a node start is tried three times.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.servers import wait_until
from tests.support.workers import Stack, session_members, worker_job_request
from tests.workers.test_e2e import (
    compressed_layers,
    fetch,
    finished_checkpoints,
    follow,
    layer_reached,
    statuses,
    submit,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RAY = str(Path(sys.executable).parent / "ray")
WORKER_NODE_RESOURCE = "ftc_worker_node"
FAST_FAILURE_DETECTION = {  # the head declares a silent node dead after ~15 s instead of ~30 s (a
    # tighter check declares healthy nodes dead on a busy machine)
    "RAY_health_check_initial_delay_ms": "2000",
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "5",
}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


NODE_MARK = "FTC_TEST_RAY_NODE"
"""An environment variable each node's `ray start` gets: its raylet, agents and the worker processes
the raylet starts inherit it, which tells the node's processes apart from every other on the machine
(Ray may put its daemons in sessions of their own)."""


def processes_marked(mark: str) -> list[int]:
    needle = f"{NODE_MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return [pid for pid in pids if pid != os.getpid()]


@dataclass
class RayNode:
    """`ray start --block`, marked so that every process of the node (raylet, object store, agents,
    the actors it hosts) can be found, and killed as a whole."""

    name: str
    arguments: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)
    mark: str = field(default_factory=lambda: uuid.uuid4().hex)

    def start(self, attempts: int = 3) -> RayNode:
        """Start the node and wait until it runs; a start that fails (a busy machine can time out
        Ray's own start-up calls) is tried again."""
        for attempt in range(1, attempts + 1):
            self._launch()
            with contextlib.suppress(TimeoutError):
                wait_until(self._started, f"ray node {self.name}", timeout=120)
                return self
            if attempt == attempts:
                raise RuntimeError(f"ray node {self.name} did not start:\n{self.log_path.read_text()[-3000:]}")
            self.kill()
        return self

    def _started(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise TimeoutError(f"ray start for {self.name} exited")
        return "Ray runtime started" in self.log_path.read_text(errors="replace")

    def _launch(self) -> None:
        agent, grpc, metrics, runtime_env = free_ports(4)
        command = [
            RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
            "--object-store-memory", str(80 * 1024**2), "--dashboard-agent-listen-port", str(agent),
            "--dashboard-agent-grpc-port", str(grpc), "--metrics-export-port", str(metrics),
            "--runtime-env-agent-port", str(runtime_env), *self.arguments,
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                command, env={**self.env, NODE_MARK: self.mark}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def members(self) -> list[int]:
        if self.process is None:
            return []
        return sorted(set(processes_marked(self.mark)) | set(session_members(self.process.pid)))

    def hosts_actor(self) -> bool:
        """Whether a worker actor's process runs on this node (Ray names it after the actor class)."""
        for pid in self.members():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::JobWorker"):
                    return True
        return False

    def describe(self) -> str:
        """The node's Ray processes, for a failure message."""
        names = []
        for pid in self.members():
            with contextlib.suppress(OSError):
                names.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"))
        return f"{self.name}: {sorted(names)}"

    def kill(self) -> None:
        """SIGKILL to every process of the node at once, as when its machine dies."""
        for signum in (signal.SIGKILL, signal.SIGKILL):
            for pid in self.members():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not self.members(), f"ray node {self.name} to die", timeout=15)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM (`ray start --block` then stops its node's processes), then SIGKILL what is left."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
        self.kill()


@pytest.fixture
def ray_nodes(tmp_path_factory: pytest.TempPathFactory):
    """`start(name, head=False) -> RayNode`; every node is stopped (and checked empty) after the test."""
    folder = tmp_path_factory.mktemp("ray-nodes")
    # Ray keeps sockets under its temp dir, whose paths must stay short (AF_UNIX limit).
    temp_dir = Path("/tmp") / f"ftc-ray-{uuid.uuid4().hex[:8]}"
    gcs_port, client_port = free_ports(2)
    env = {**os.environ, **FAST_FAILURE_DETECTION}
    env.pop("RAY_ADDRESS", None)
    nodes: list[RayNode] = []

    def start(name: str, head: bool = False) -> RayNode:
        if head:
            arguments = ["--head", "--port", str(gcs_port), "--num-cpus", "1", "--include-dashboard", "false",
                         "--ray-client-server-port", str(client_port), "--temp-dir", str(temp_dir)]
        else:
            arguments = ["--address", f"127.0.0.1:{gcs_port}", "--num-cpus", "1",
                         "--resources", json.dumps({WORKER_NODE_RESOURCE: 1})]
        node = RayNode(name, arguments, env, folder / f"{name}.log").start()
        nodes.append(node)
        return node

    start.address = f"127.0.0.1:{gcs_port}"  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for node in reversed(nodes):
            node.stop()
        leftovers = {node.name: node.members() for node in nodes if node.members()}
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftovers, f"Ray nodes left processes behind: {leftovers}"


def test_a_job_runs_on_the_worker_node_and_survives_that_node_dying(
    stack: Stack, models_dir, ray_nodes, tmp_path: Path
) -> None:
    _root, model = models_dir(layers=16)
    head = ray_nodes("head", head=True)
    node_b = ray_nodes("node-b")
    placement = {"RAY_ADDRESS": ray_nodes.address, "FTC_ACTOR_RESOURCES": json.dumps({WORKER_NODE_RESOURCE: 1})}
    supervisor = stack.start_worker("two-nodes", env=placement)
    try:
        with contextlib.suppress(TimeoutError):  # Ray renames the actor's process once it is created
            wait_until(node_b.hosts_actor, "the actor's process on node B", timeout=30)
        where = f"{head.describe()}\n{node_b.describe()}\n{supervisor.log_text()[-3000:]}"
        assert node_b.hosts_actor() and not head.hosts_actor(), f"the actor runs on the resource node:\n{where}"
        job_id = submit(stack, worker_job_request(model))
        follow(stack, job_id, stop=layer_reached(3))
        node_b.kill()
        assert not head.hosts_actor(), "the head has a free CPU but not the resource: the replacement waits"
        restored = finished_checkpoints(stack, job_id)
        assert 3 <= restored < 16

        node_c = ray_nodes("node-c")
        events = follow(stack, job_id)
        assert node_c.hosts_actor(), f"the replacement actor runs on the new worker node:\n{node_c.describe()}"
        assert statuses(events) == ["queued", "running", "queued", "running", "succeeded"]
        second_run = events[[i for i, (kind, _) in enumerate(events) if kind == "status"][3] :]
        assert compressed_layers(second_run) == list(range(restored, 17)), "no finished layer is computed again"
        metrics = json.loads((fetch(stack, job_id, tmp_path / "artifact") / "metrics.json").read_text())
        assert metrics["resumed_from_layer"] == restored and metrics["attempt"] == 2
        actor_pid = int(metrics["worker"].rsplit("-", 2)[1])
        assert actor_pid in node_c.members(), "the second attempt ran on node C"
        assert "starting a new one" in supervisor.log_text(), "the supervisor replaced the actor it lost"
    finally:
        supervisor.stop()
    assert not supervisor.leftovers()

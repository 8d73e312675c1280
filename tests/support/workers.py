"""The worker tests' processes: `ftc worker` as a subprocess in its own session, the whole stack of
real processes (Redis, an S3-compatible server over HTTP, the API, workers on local Ray), and the
small job request they run.

Every `ftc worker` started here runs in its own session; stopping it also ends whatever Ray left
in that session, and the tests check that nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cli.client import ApiClient
from service.settings import Settings
from service.store import ObjectStore, store_for
from tests.support.servers import TcpRelay, wait_until
from tests.support.service import TEAM_KEYS


def worker_job_request(model: str, **changes: Any) -> dict[str, Any]:
    """A small FTC job on `model` (4 x 64 calibration tokens, 2 evaluation windows): seconds on a CPU."""
    request = {
        "model": model,
        "method": "ftc",
        "ratio": 0.5,
        "calibration": {"dataset": "wikitext2", "samples": 4, "seq_len": 64, "seed": 0},
        "eval": {"datasets": ["wikitext2"], "seq_len": 64, "max_windows": 2},
    }
    return request | changes


REPO = Path(__file__).resolve().parents[2]
WORKER_READY_SECONDS = 180.0  # Ray, then torch in the actor, on a busy two-core machine


# --- processes ---------------------------------------------------------------------------------------


def session_members(session: int) -> list[int]:
    """Pids of live processes in a session: Ray's processes stay in the session of `ftc worker`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session and fields[0] != "Z":
                members.append(int(entry.name))
    return members


@dataclass
class WorkerProcess:
    """`ftc worker` as a subprocess leading its own session."""

    name: str
    command: list[str]
    env: dict[str, str]
    workdir: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def start(self) -> WorkerProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                self.command, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        started_workers.append(self)
        try:
            wait_until(self._ready, f"ftc worker {self.name}", timeout=WORKER_READY_SECONDS)
        except TimeoutError:
            tail = "\n".join(self.log_text().splitlines()[-40:])
            self.stop()
            raise TimeoutError(f"ftc worker {self.name} did not become ready; log:\n{tail}") from None
        return self

    def _ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"ftc worker {self.name} exited:\n{self.log_text()[-4000:]}")
        return "ftc worker: ready" in self.log_text()

    @property
    def session(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL to every process of the worker at once, as when its machine dies. Ray puts each actor
        in a process group of its own, so the whole session is the unit, not the process group."""
        if self.process is not None:
            for pid in session_members(self.session):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait(10)
            self._reap_session(signal.SIGKILL)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the supervisor (as an orchestrator sends it), then make sure the session is empty."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._reap_session(signal.SIGTERM)

    def _reap_session(self, first: int) -> None:
        """Wait for the session to empty; what lingers gets `first`, then SIGKILL."""
        for signum in (first, signal.SIGKILL, None):
            deadline = time.monotonic() + 15
            while session_members(self.session) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not session_members(self.session) or signum is None:
                return
            for pid in session_members(self.session):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    def actor_pids(self) -> list[int]:
        """The worker actors' processes (Ray names them after the actor class)."""
        pids = []
        for pid in session_members(self.session):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::JobWorker"):
                    pids.append(pid)
        return pids

    def leftovers(self) -> list[int]:
        return session_members(self.session) if self.process is not None else []


started_workers: list[WorkerProcess] = []
"""Every worker process started in this session, so the session can stop what a failing test left."""


# --- the whole stack ---------------------------------------------------------------------------------


@dataclass
class Stack:
    """The API (a process), Redis and S3 as the workers see them, and a way to start workers."""

    api_url: str
    settings: Settings
    worker_env: dict[str, str]
    relay: TcpRelay
    workdir: Path

    @contextlib.contextmanager
    def client(self, team: str = "team-a") -> Iterator[ApiClient]:
        client = ApiClient(self.api_url, TEAM_KEYS[team], timeout=30)
        try:
            yield client
        finally:
            client.close()

    def get(self, path: str, team: str = "team-a") -> Any:
        """GET an API path as `team`, for what the command-line client has no method for."""
        response = httpx.get(self.api_url + path, headers={"Authorization": f"Bearer {TEAM_KEYS[team]}"}, timeout=30)
        response.raise_for_status()
        return response.json()

    def store(self) -> ObjectStore:
        """The object store, reached directly (not through the relay the workers use)."""
        return store_for(self.settings)

    def start_worker(self, name: str, *, num_workers: int = 1, env: dict[str, str] | None = None) -> WorkerProcess:
        command = [sys.executable, "-m", "cli", "worker", "--num-workers", str(num_workers), "--device", "cpu"]
        worker = WorkerProcess(name, command, {**self.worker_env, **(env or {})}, self.workdir / name)
        return worker.start()


def download(url: str, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with httpx.stream("GET", url, timeout=60) as response:
        response.raise_for_status()
        with open(target, "wb") as out:
            for chunk in response.iter_bytes():
                out.write(chunk)
    return target

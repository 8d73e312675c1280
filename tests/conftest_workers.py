"""Fixtures for the worker tests: tiny models in a models folder, worker settings, and a full stack
of real processes (Redis, an S3-compatible server over HTTP, the API, `ftc worker` on local Ray).

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
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client import ApiClient
from service.settings import Settings
from service.store import ObjectStore, store_for
from tests.conftest_service import API_KEYS, S3_BUCKET, TEAM_KEYS
from tests.servers import MotoServer, RedisServer, TcpRelay, start_api, wait_until
from workers.settings import WorkerSettings


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


REPO = Path(__file__).resolve().parents[1]
WORKER_READY_SECONDS = 180.0  # Ray, then torch in the actor, on a busy two-core machine


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory, tiny_folder) -> Callable[..., tuple[Path, str]]:
    """`tiny(layers=4, hidden=128)` -> (models folder, model name): a tiny Llama-style model the
    workers find as `{models folder}/{name}`, as a deployment mounts its models."""
    root = tmp_path_factory.mktemp("models")

    def tiny(layers: int = 4, hidden: int = 128) -> tuple[Path, str]:
        name = f"tiny/gqa-{layers}x{hidden}"
        link = root / name
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(tiny_folder("gqa", layers=layers, hidden=hidden), target_is_directory=True)
        return root, name

    return tiny


@pytest.fixture
def worker_settings(service_settings, models_dir, tmp_path: Path) -> Callable[..., WorkerSettings]:
    """`make(backend="local"|"s3", **overrides)`: worker settings on this test's private Redis prefix and store."""

    def make(backend: str = "local", **overrides: Any) -> WorkerSettings:
        base = service_settings(backend).model_dump()
        root, _name = models_dir()
        values = {"models_dir": str(root), "work_dir": str(tmp_path / "worker"), "device": "cpu"}
        return WorkerSettings(**(base | values | overrides))

    return make


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
        _started.append(self)
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


_started: list[WorkerProcess] = []


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_workers() -> Iterator[None]:
    """Whatever a failing test left running is stopped at the end of the session."""
    yield
    for worker in _started:
        with contextlib.suppress(Exception):
            worker.stop(timeout=20)


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
        command = [sys.executable, "-m", "ftc.cli", "worker", "--num-workers", str(num_workers), "--device", "cpu"]
        worker = WorkerProcess(name, command, {**self.worker_env, **(env or {})}, self.workdir / name)
        return worker.start()


@pytest.fixture(scope="module")
def stack(
    redis_server: RedisServer, moto_server: MotoServer, models_dir, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A fresh key prefix and S3 prefix; the API process reaches S3 directly, workers through a relay
    that tests can cut (an object-store outage)."""
    workdir = tmp_path_factory.mktemp("stack")
    unique = uuid.uuid4().hex[:12]
    port = int(moto_server.url.rsplit(":", 1)[1])
    relay = TcpRelay(port).open()
    common = {
        "FTC_API_KEYS": API_KEYS,
        "FTC_REDIS_URL": redis_server.url,
        "FTC_KEY_PREFIX": f"stack-{unique}",
        "FTC_STORE_URL": f"s3://{S3_BUCKET}/{unique}",
        "FTC_LEASE_SECONDS": "5",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # Only the workers' janitor re-delivers here, so the tests show that `ftc worker` alone loses no job.
    api_env = {**common, "FTC_S3_ENDPOINT_URL": moto_server.url, "FTC_JANITOR_INTERVAL_SECONDS": "0"}
    api = start_api(workdir / "api", api_env)
    root, _name = models_dir()
    worker_env = {
        **os.environ,
        **common,
        "FTC_S3_ENDPOINT_URL": f"http://127.0.0.1:{relay.port}",
        "FTC_JANITOR_INTERVAL_SECONDS": "1",
        "FTC_STORE_RETRIES": "8",
        "FTC_STORE_BACKOFF_SECONDS": "0.2",
        "FTC_MODELS_DIR": str(root),
        "FTC_WORK_DIR": str(workdir / "scratch"),
        "PYTHONPATH": str(REPO),
    }
    worker_env.pop("RAY_ADDRESS", None)  # always a private local cluster
    settings = Settings(
        api_keys=API_KEYS,
        redis_url=redis_server.url,
        key_prefix=common["FTC_KEY_PREFIX"],
        store_url=common["FTC_STORE_URL"],
        s3_endpoint_url=moto_server.url,
    )
    try:
        yield Stack(f"http://127.0.0.1:{api.port}", settings, worker_env, relay, workdir)
    finally:
        api.stop()
        relay.close()


@pytest.fixture(scope="module")
def worker(stack: Stack) -> Iterator[WorkerProcess]:
    """One `ftc worker` (one CPU actor) shared by the tests of a module."""
    process = stack.start_worker("worker")
    yield process
    process.stop()
    assert not process.leftovers(), f"ftc worker left processes behind: {process.leftovers()}"


def download(url: str, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with httpx.stream("GET", url, timeout=60) as response:
        response.raise_for_status()
        with open(target, "wb") as out:
            for chunk in response.iter_bytes():
                out.write(chunk)
    return target

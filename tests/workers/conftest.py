"""Fixtures of the worker tests: tiny models in a models folder, worker settings, and the stack of
real processes (see tests/support/workers.py)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.settings import Settings
from tests.support.servers import MotoServer, RedisServer, TcpRelay, start_api
from tests.support.service import API_KEYS, S3_BUCKET
from tests.support.workers import REPO, Stack, WorkerProcess, started_workers
from workers.settings import WorkerSettings


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


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_workers() -> Iterator[None]:
    """Whatever a failing test left running is stopped at the end of the session."""
    yield
    for worker in started_workers:
        with contextlib.suppress(Exception):
            worker.stop(timeout=20)


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

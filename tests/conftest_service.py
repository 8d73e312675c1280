"""Fixtures for the job service: a real redis-server, a real S3-compatible server, and API instances.

One redis-server and one moto server run per session; each test still gets a clean world because
its settings carry a fresh Redis key prefix and a fresh store folder or S3 prefix. Later suites
(workers, end to end) can reuse `service_settings`, `api` / `api_factory` and `run_async`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from api.app import create_app
from service.runtime import Services
from service.settings import Settings
from tests.servers import (
    S3_ENV,
    MotoServer,
    RedisServer,
    redis_server_binary,
    serve_in_thread,
    start_moto,
    start_redis,
)

T = TypeVar("T")

TEAM_KEYS = {"team-a": "key-team-a-0123456789", "team-b": "key-team-b-0123456789"}
"""Two teams, to show that neither can see the other's jobs."""
API_KEYS = ",".join(f"{key}:{team}" for team, key in TEAM_KEYS.items())
S3_BUCKET = "ftc-test"


def require_redis_server() -> None:
    """Skip without redis-server, except under CI=true, where a missing Redis is a failure."""
    if redis_server_binary() is None:
        message = "redis-server is not installed (make setup installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; CI must run the service tests against a real Redis", pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A private redis-server for the session (never the machine's own)."""
    require_redis_server()
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """moto's S3 server as a subprocess with one bucket; boto3 reaches it over HTTP."""
    saved = {name: os.environ.get(name) for name in S3_ENV}
    os.environ.update(S3_ENV)
    server = start_moto(tmp_path_factory.mktemp("moto"))
    server.create_bucket(S3_BUCKET)
    yield server
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def service_settings(
    request: pytest.FixtureRequest, redis_server: RedisServer, tmp_path: Path
) -> Callable[..., Settings]:
    """`make(backend="local"|"s3", **overrides)`: settings isolated to this test."""

    def make(backend: str = "local", **overrides: Any) -> Settings:
        unique = uuid.uuid4().hex[:12]
        if backend == "s3":
            moto: MotoServer = request.getfixturevalue("moto_server")
            store = {"store_url": f"s3://{S3_BUCKET}/{unique}", "s3_endpoint_url": moto.url}
        else:
            store = {"store_url": str(tmp_path / f"store-{unique}")}
        values = {
            "redis_url": redis_server.url,
            "key_prefix": f"test-{unique}",
            "api_keys": API_KEYS,
            "janitor_interval_seconds": 0,
            "store_retries": 2,
            "store_backoff_seconds": 0.05,
            **store,
        }
        return Settings(**(values | overrides))

    return make


def run_async(settings: Settings, work: Callable[[Services], Awaitable[T]]) -> T:
    """Run `work(services)` on a fresh event loop with its own clients: how tests act as a worker."""

    async def main() -> T:
        services = Services.open(settings)
        try:
            return await work(services)
        finally:
            await services.close()

    return asyncio.run(main())


@dataclass
class Api:
    """A running API (real HTTP, in a thread) and the settings it was made with."""

    base_url: str
    settings: Settings
    _clients: list[httpx.Client]

    def client(self, team: str | None = "team-a", key: str | None = None) -> httpx.Client:
        """An HTTP client holding `team`'s key (or `key`; neither: no Authorization header)."""
        key = key if key is not None else TEAM_KEYS.get(team or "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        client = httpx.Client(base_url=self.base_url, headers=headers, timeout=30)
        self._clients.append(client)
        return client

    def run(self, work: Callable[[Services], Awaitable[T]]) -> T:
        return run_async(self.settings, work)


@pytest.fixture
def api_factory(service_settings: Callable[..., Settings]) -> Iterator[Callable[..., Api]]:
    """`start(backend="local"|"s3", **setting overrides) -> Api`; everything stops after the test."""
    with contextlib.ExitStack() as stack:

        def start(backend: str = "local", **overrides: Any) -> Api:
            settings = service_settings(backend, **overrides)
            base_url = stack.enter_context(serve_in_thread(create_app(settings)))
            api = Api(base_url=base_url, settings=settings, _clients=[])
            stack.callback(lambda: [c.close() for c in api._clients])
            return api

        yield start


@pytest.fixture
def api(api_factory: Callable[..., Api]) -> Api:
    """The API on a local-folder store."""
    return api_factory("local")


@pytest.fixture(params=["local", "s3"])
def any_store_api(request: pytest.FixtureRequest, api_factory: Callable[..., Api]) -> Api:
    """The API once on a local-folder store and once on S3 (moto over HTTP)."""
    return api_factory(request.param)


JOB_REQUEST = {
    "model": "smollm2-135m",
    "method": "ftc",
    "ratio": 0.4,
    "calibration": {"dataset": "wikitext2", "samples": 8, "seq_len": 256, "seed": 0},
    "eval": {"datasets": ["wikitext2"], "seq_len": 256, "max_windows": 4},
}
"""The example request of the issue."""


@pytest.fixture
def job_request() -> dict[str, Any]:
    return {**JOB_REQUEST, "calibration": dict(JOB_REQUEST["calibration"]), "eval": dict(JOB_REQUEST["eval"])}

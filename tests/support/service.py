"""What the service tests share besides fixtures: the teams and keys, a running-API handle, the
example job request, and a way to act as a worker on a fresh event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from service.runtime import Services
from service.settings import Settings
from tests.support.servers import redis_server_binary
from tests.support.tools import require_tool

T = TypeVar("T")

TEAM_KEYS = {"team-a": "key-team-a-0123456789", "team-b": "key-team-b-0123456789"}
"""Two teams, to show that neither can see the other's jobs."""
API_KEYS = ",".join(f"{key}:{team}" for team, key in TEAM_KEYS.items())
TEAMS = '{"team-a": {"high_priority": true}}'
"""FTC_TEAMS of the test deployment: team-a may use priority high, team-b has the defaults."""
S3_BUCKET = "ftc-test"


def require_redis_server() -> None:
    """Skip without redis-server, except under CI=true, where a missing Redis is a failure."""
    require_tool("redis-server", "make setup installs it (as root); the service tests need a real Redis",
                 redis_server_binary())


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


JOB_REQUEST = {
    "model": "smollm2-135m",
    "method": "ftc",
    "ratio": 0.4,
    "calibration": {"dataset": "wikitext2", "samples": 8, "seq_len": 256, "seed": 0},
    "eval": {"datasets": ["wikitext2"], "seq_len": 256, "max_windows": 4},
}
"""The example request of the issue."""

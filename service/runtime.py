"""The service objects one process needs, opened together from the settings.

The API holds one of these for its lifetime; workers and tools can do the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from service.jobs import JobStore
from service.keys import Keys
from service.queue import Queue
from service.redis_client import connect
from service.retry import RetryPolicy
from service.settings import Settings
from service.store import ObjectStore, store_for
from service.teams import TeamPolicies, policies_for


@dataclass
class Services:
    settings: Settings
    redis: Redis
    jobs: JobStore
    queue: Queue
    store: ObjectStore
    teams: TeamPolicies

    @classmethod
    def open(cls, settings: Settings, store: ObjectStore | None = None) -> Services:
        """Build the clients; nothing is contacted yet, so this works while Redis is down.
        Raises ValueError for an unusable FTC_TEAMS."""
        teams = policies_for(settings)
        redis = connect(settings)
        keys = Keys(settings.key_prefix)
        return cls(
            settings=settings,
            redis=redis,
            jobs=JobStore(redis, keys, idempotency_ttl_seconds=settings.idempotency_ttl_seconds),
            queue=Queue(redis, keys, RetryPolicy.from_settings(settings), teams),
            store=store or store_for(settings),
            teams=teams,
        )

    async def close(self) -> None:
        await self.redis.aclose()

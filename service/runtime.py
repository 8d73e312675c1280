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


@dataclass
class Services:
    settings: Settings
    redis: Redis
    jobs: JobStore
    queue: Queue
    store: ObjectStore

    @classmethod
    def open(cls, settings: Settings, store: ObjectStore | None = None) -> Services:
        """Build the clients; nothing is contacted yet, so this works while Redis is down."""
        redis = connect(settings)
        keys = Keys(settings.key_prefix)
        return cls(
            settings=settings,
            redis=redis,
            jobs=JobStore(redis, keys, idempotency_ttl_seconds=settings.idempotency_ttl_seconds),
            queue=Queue(redis, keys, RetryPolicy.from_settings(settings)),
            store=store or store_for(settings),
        )

    async def close(self) -> None:
        await self.redis.aclose()

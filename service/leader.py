"""A leader lock in Redis: one holder at a time, lost unless renewed, handed over when released.

The holder's random token is the value; renewal and release are compare-and-act scripts, so a
process that lost the lock (paused past its expiry) can never extend or delete its successor's.
Expiry is Redis's own clock, which is what lets a standby take over from a killed holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from service.redis_client import REDIS_DOWN_ERRORS

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaderLock:
    def __init__(self, redis: Redis, key: str, holder: str, ttl_seconds: float = 30.0) -> None:
        self.redis = redis
        self.key = key
        self.token = f"{holder}:{secrets.token_hex(8)}"
        self.ttl_ms = int(ttl_seconds * 1000)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def acquire_or_renew(self) -> bool:
        """Take the lock when it is free, or extend it when it is ours. Returns whether we hold it."""
        if await self._renew(keys=[self.key], args=[self.token, self.ttl_ms]):
            return True
        return bool(await self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms))

    async def release(self) -> None:
        """Hand the lock over at once (a clean shutdown), instead of making the standby wait for expiry."""
        await self._release(keys=[self.key], args=[self.token])

    async def holder(self) -> str | None:
        return await self.redis.get(self.key)

    @contextlib.asynccontextmanager
    async def kept(self) -> AsyncIterator[None]:
        """Keep renewing in the background while the body runs (a long report must not lose the lock)."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.ttl_ms / 3000)
                try:
                    if not await self.acquire_or_renew():
                        log.warning("lost the lock %s to another holder", self.key)
                except REDIS_DOWN_ERRORS as error:
                    log.warning("could not renew the lock %s: %s", self.key, error)

        task = asyncio.create_task(renew())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

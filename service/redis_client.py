"""One way to open Redis, tuned for a service that must answer fast when Redis is gone."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.settings import Settings

REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
"""What an unreachable, restarting or still-loading Redis raises."""


def connect(settings: Settings) -> Redis:
    """An asyncio Redis client with short timeouts and a single quick retry.

    redis-py's default retries for seconds; a request should instead fail in well under a second
    with a clear 503 so clients can back off, while a one-off dropped connection is still retried.
    """
    return Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_timeout=settings.redis_timeout_seconds,
        socket_connect_timeout=settings.redis_timeout_seconds,
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=1),
        health_check_interval=30,
    )

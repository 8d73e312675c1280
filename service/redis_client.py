"""One way to open Redis, tuned for a service that must answer fast when Redis is gone or hung."""

from __future__ import annotations

import redis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from service.settings import Settings

REDIS_DOWN_ERRORS: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError)
"""What an unreachable, restarting, hung or still-loading Redis raises."""

MAX_CONNECTIONS = 100
"""Connections of one process's pool. More concurrent commands than this wait for a free one (up to
the timeout) instead of failing at once with 'Too many connections'."""


def connect(settings: Settings, *, max_connections: int = MAX_CONNECTIONS) -> Redis:
    """An asyncio Redis client whose every command answers or fails within about `redis_timeout_seconds`.

    Only a dropped connection is retried (once, at once): that is what a restarted Redis or an idle
    connection closed by a proxy looks like, and a fresh connection fixes it. A timeout is not
    retried, and there is no periodic health-check PING: against a hung Redis (SIGSTOP, a full
    network buffer) each of those would add another full timeout before the 503, as they once did
    (4 to 8.6 s instead of the documented ~2 s). A burst of requests larger than the pool queues
    for connections for at most the same timeout.
    """
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=max_connections,
        timeout=settings.redis_timeout_seconds,
        decode_responses=True,
        socket_timeout=settings.redis_timeout_seconds,
        socket_connect_timeout=settings.redis_timeout_seconds,
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=1, supported_errors=(RedisConnectionError,)),
        health_check_interval=0,
    )
    return Redis.from_pool(pool)


def connect_sync(settings: Settings) -> redis.Redis:
    """A blocking client with the same timeouts and retry as `connect`, for code that runs in a worker's
    compression thread, away from its event loop (the shared layer plans' lease, service/plans.py)."""
    return redis.Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_timeout=settings.redis_timeout_seconds,
        socket_connect_timeout=settings.redis_timeout_seconds,
        retry=SyncRetry(ExponentialBackoff(cap=0.05, base=0.01), retries=1, supported_errors=(RedisConnectionError,)),
        health_check_interval=0,
    )

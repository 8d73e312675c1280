"""The job queue: Redis Streams read by one consumer group of workers, with leases and a janitor.

Submission (service.jobs) appends a job id to the stream of its priority. A worker claims the next
job with XREADGROUP, highest priority first; the stream's pending-entries list is the lease: the
worker renews it (heartbeat) by re-claiming its own entry, which resets the entry's idle time. The
janitor takes entries idle longer than the lease with XAUTOCLAIM and re-delivers their jobs to the
queue, or fails them once they used up their attempts, with the reason in the job record.
Lease length and attempts come from the one `RetryPolicy` (service/retry.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from service.errors import LeaseLost
from service.keys import CONSUMER_GROUP, LUA_PRELUDE, Keys
from service.retry import RetryPolicy
from service.schemas import PRIORITIES

log = logging.getLogger(__name__)

_CLAIM = (
    LUA_PRELUDE
    + """
local id, worker, now, lease_until = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local key = job_key(id)
local status, team = unpack(redis.call('HMGET', key, 'status', 'team'))
if status ~= 'queued' then return {status or 'missing', 0} end
local attempts = redis.call('HINCRBY', key, 'attempts', 1)
redis.call('HSET', key, 'worker', worker, 'started_at', now, 'lease_until', lease_until)
set_status(id, team, status, 'running', now, {attempts = attempts, worker = worker})
return {'running', attempts}
"""
)

_HEARTBEAT = (
    LUA_PRELUDE
    + """
local id, worker, lease_until, stream, group, entry = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local pending = redis.call('XPENDING', stream, group, entry, entry, 1)
if #pending == 0 or pending[1][2] ~= worker then return {'lost', '0'} end
local status, owner, flagged = unpack(redis.call('HMGET', job_key(id), 'status', 'worker',
  'cancel_requested'))
if status ~= 'running' or owner ~= worker then return {'lost', '0'} end
redis.call('XCLAIM', stream, group, worker, 0, entry, 'JUSTID')
redis.call('HSET', job_key(id), 'lease_until', lease_until)
return {'held', flagged or '0'}
"""
)

_REAP = (
    LUA_PRELUDE
    + """
local id, stream, group, entry, max_attempts, now, lease = ARGV[2], ARGV[3], ARGV[4], ARGV[5],
  tonumber(ARGV[6]), ARGV[7], ARGV[8]
local key = job_key(id)
redis.call('XACK', stream, group, entry)
redis.call('XDEL', stream, entry)
local status, team, attempts, flagged, worker = unpack(redis.call('HMGET', key, 'status', 'team',
  'attempts', 'cancel_requested', 'worker'))
if status ~= 'queued' and status ~= 'running' then return 'dropped' end
if flagged == '1' then
  redis.call('HSET', key, 'finished_at', now)
  set_status(id, team, status, 'cancelled', now, {reason = 'cancelled while its worker was lost'})
  return 'cancelled'
end
attempts = tonumber(attempts or '0')
if attempts >= max_attempts then
  local reason = 'gave up after ' .. attempts .. ' of ' .. max_attempts .. ' attempts: worker '
    .. (worker or '?') .. ' stopped renewing its ' .. lease .. ' s lease (crashed, killed or hung)'
  redis.call('HSET', key, 'finished_at', now, 'error', reason, 'error_kind', 'worker_lost')
  set_status(id, team, status, 'failed', now, {error = reason})
  return 'failed'
end
local fresh = redis.call('XADD', stream, '*', 'job', id)
redis.call('HSET', key, 'entry', fresh, 'worker', '', 'lease_until', '')
set_status(id, team, status, 'queued', now, {attempts = attempts,
  reason = 'worker ' .. (worker or '?') .. ' lost its lease; re-delivered'})
return 'requeued'
"""
)


@dataclass(frozen=True)
class Lease:
    """A worker's hold on one job, valid while it keeps renewing it."""

    job_id: str
    worker: str
    stream: str
    entry: str
    attempt: int


class Queue:
    """The priority streams and their consumer group."""

    def __init__(self, redis: Redis, keys: Keys, policy: RetryPolicy | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.policy = policy or RetryPolicy()
        self.lease_seconds = self.policy.lease_seconds
        self.max_attempts = self.policy.max_attempts
        self._claim = redis.register_script(_CLAIM)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._reap = redis.register_script(_REAP)

    async def ensure_group(self) -> None:
        """Create the consumer group on every priority stream (a no-op when it exists)."""
        for stream in self.keys.queues():
            try:
                await self.redis.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise

    async def claim(self, worker: str, block_ms: int = 5000) -> Lease | None:
        """Take the next job, highest priority first, waiting up to `block_ms`; None when there is none.

        Entries whose job was cancelled (or vanished) while queued are acknowledged and skipped.
        """
        deadline = time.monotonic() + block_ms / 1000
        while True:
            for stream in self.keys.queues():
                entry = await self._read_one(stream, worker)
                if entry is None:
                    continue
                lease = await self._take(stream, worker, *entry)
                if lease is not None:
                    return lease
                break  # skipped a dead entry: look again from the highest priority
            else:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0:
                    return None
                await self._wait_for_entries(min(remaining_ms, 1000))

    async def _read_one(self, stream: str, worker: str) -> tuple[str, str] | None:
        try:
            reply = await self.redis.xreadgroup(CONSUMER_GROUP, worker, {stream: ">"}, count=1)
        except ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            await self.ensure_group()  # first use, or Redis lost the group (restart without persistence)
            reply = await self.redis.xreadgroup(CONSUMER_GROUP, worker, {stream: ">"}, count=1)
        if not reply:
            return None
        entry, fields = reply[0][1][0]
        return entry, fields.get("job", "")

    async def _wait_for_entries(self, block_ms: int) -> None:
        """Sleep until any priority stream gets a new entry, without taking it (plain XREAD).

        An entry added between the group reads and this call is noticed at the timeout, so the
        wait is capped at a second by the caller.
        """
        await self.redis.xread({stream: "$" for stream in self.keys.queues()}, count=1, block=block_ms)

    async def _take(self, stream: str, worker: str, entry: str, job_id: str) -> Lease | None:
        now = time.time()
        status, attempt = await self._claim(
            args=[self.keys.prefix, job_id, worker, repr(now), repr(now + self.lease_seconds)]
        )
        if status != "running":
            await self.ack_entry(stream, entry)
            return None
        return Lease(job_id=job_id, worker=worker, stream=stream, entry=entry, attempt=int(attempt))

    async def heartbeat(self, lease: Lease) -> bool:
        """Renew the lease. Returns whether the job should stop (cancel requested).

        Raises LeaseLost when the janitor already gave the job to someone else (or it ended).
        """
        state, flagged = await self._heartbeat(
            args=[
                self.keys.prefix,
                lease.job_id,
                lease.worker,
                repr(time.time() + self.lease_seconds),
                lease.stream,
                CONSUMER_GROUP,
                lease.entry,
            ]
        )
        if state == "lost":
            raise LeaseLost(lease.job_id, lease.worker)
        return flagged == "1"

    async def ack(self, lease: Lease) -> None:
        """Drop the job's queue entry once its record says how it ended."""
        await self.ack_entry(lease.stream, lease.entry)

    async def ack_entry(self, stream: str, entry: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(stream, CONSUMER_GROUP, entry)
            pipe.xdel(stream, entry)
            await pipe.execute()

    async def reap(self, janitor: str = "janitor") -> Counter[str]:
        """Re-deliver or fail every job whose lease expired; returns how many went which way."""
        outcomes: Counter[str] = Counter()
        min_idle_ms = self.lease_seconds * 1000
        for stream in self.keys.queues():
            start = "0-0"
            while True:
                try:
                    start, entries, *_deleted = await self.redis.xautoclaim(
                        stream, CONSUMER_GROUP, janitor, min_idle_ms, start_id=start, count=100
                    )
                except ResponseError as error:
                    if "NOGROUP" not in str(error):
                        raise
                    await self.ensure_group()
                    break
                for entry, fields in entries:
                    outcome = await self._reap(
                        args=[
                            self.keys.prefix,
                            (fields or {}).get("job", ""),
                            stream,
                            CONSUMER_GROUP,
                            entry,
                            self.max_attempts,
                            repr(time.time()),
                            self.lease_seconds,
                        ]
                    )
                    outcomes[outcome] += 1
                if start == "0-0":
                    break
        return outcomes

    async def depth(self) -> dict[str, int]:
        """Jobs waiting for a worker, per priority (entries not yet delivered to the group)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in self.keys.queues():
                pipe.xlen(stream)
                pipe.xpending(stream, CONSUMER_GROUP)
            replies = await pipe.execute(raise_on_error=False)
        depths = {}
        for priority, length, pending in zip(PRIORITIES, replies[::2], replies[1::2], strict=True):
            if isinstance(length, Exception):
                raise length
            delivered = pending["pending"] if isinstance(pending, dict) else 0
            depths[priority] = max(0, int(length) - int(delivered))
        return depths


async def run_janitor(queue: Queue, interval_seconds: float, stop: asyncio.Event) -> None:
    """Reap expired leases every `interval_seconds` until `stop` is set; Redis outages are waited out."""
    while not stop.is_set():
        try:
            outcomes = await queue.reap()
            if outcomes:
                log.info("janitor: %s", dict(outcomes))
        except Exception as error:  # keep the janitor alive through Redis restarts
            log.warning("janitor pass failed: %s", error)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_seconds)

"""The job queue: a Redis stream per team and priority, read by one consumer group of workers,
served to the teams in turn, with leases and a janitor.

Submission (service.jobs) appends a job id to its team's stream for its priority. A claim (one Lua
script, so two workers never take the same job and a job is never half taken) looks at the
priorities highest first and, within one, at the teams with waiting jobs in order of their *pass*:
the team with the lowest pass is served and its pass grows by 1 / its weight (stride scheduling).
Teams with equal weights are thus served in turn, however many jobs one of them queued, and a team
with weight 2 gets two turns to another's one. A team that starts waiting joins at the pass of
the team served last, so it is served next, not first by a debt it ran up while idle. A team at
its running limit is passed over until one of its jobs ends.

The stream's pending-entries list is the lease: the worker renews it (heartbeat) by re-claiming its
own entry, which resets the entry's idle time. The janitor takes entries idle longer than the lease
with XAUTOCLAIM and re-delivers their jobs to their team's stream, or fails them once they used up
their attempts, with the reason in the job record. Lease length and attempts come from the one
`RetryPolicy` (service/retry.py); weights and running limits from `TeamPolicies` (service/teams.py).
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
from service.teams import TeamPolicies

log = logging.getLogger(__name__)

SIGNAL_WAIT_MS = 1000
"""Longest single wait for new work: below the Redis socket timeout, so a wait never looks like an outage."""
SKIPS_PER_CLAIM = 100
"""Dead entries (jobs cancelled or gone while queued) one claim script drops before it hands back."""

_CLAIM = (
    LUA_PRELUDE
    + f"""
local worker, now, lease_until = ARGV[2], ARGV[3], ARGV[4]
local default_weight, default_running = tonumber(ARGV[5]), tonumber(ARGV[6])
local policies = cjson.decode(ARGV[7])
local skipped = 0
for i = 8, #ARGV do
  local priority = ARGV[i]
  local turns = redis.call('ZRANGE', turns_key(priority), 0, -1, 'WITHSCORES')
  for t = 1, #turns, 2 do
    local team, pass = turns[t], tonumber(turns[t + 1])
    local policy = policies[team]
    local weight = policy and policy[1] or default_weight
    local most = policy and policy[2] or default_running
    if most == 0 or redis.call('ZCARD', team_status_key(team, 'running')) < most then
      local stream = queue_key(priority, team)
      while true do
        local reply = redis.pcall('XREADGROUP', 'GROUP', group, worker, 'COUNT', 1, 'STREAMS', stream, '>')
        if type(reply) == 'table' and reply.err then  -- the group is gone (Redis restarted without its data)
          ensure_group(stream)
          reply = redis.call('XREADGROUP', 'GROUP', group, worker, 'COUNT', 1, 'STREAMS', stream, '>')
        end
        if not reply then  -- nothing left to deliver: the team waits no more at this priority
          redis.call('ZREM', turns_key(priority), team)
          break
        end
        local entry, id = reply[1][2][1][1], reply[1][2][1][2][2]
        local key = job_key(id)
        local status, owner = unpack(redis.call('HMGET', key, 'status', 'team'))
        if status == 'queued' then
          local attempts = redis.call('HINCRBY', key, 'attempts', 1)
          redis.call('HSET', key, 'worker', worker, 'started_at', now, 'lease_until', lease_until)
          set_status(id, owner, status, 'running', now, {{attempts = attempts, worker = worker}})
          redis.call('SET', clock_key(priority), tostring(pass))
          redis.call('ZADD', turns_key(priority), tostring(pass + 1 / weight), team)
          return {{'running', id, stream, entry, attempts}}
        end
        redis.call('XACK', stream, group, entry)  -- cancelled or gone while queued: drop, look further
        redis.call('XDEL', stream, entry)
        skipped = skipped + 1
        if skipped >= {SKIPS_PER_CLAIM} then return {{'again'}} end
      end
    end
  end
end
local newest = redis.call('XREVRANGE', signal_key, '+', '-', 'COUNT', 1)
return {{'empty', newest[1] and newest[1][1] or '0-0'}}
"""
)

_ADOPT = (
    LUA_PRELUDE
    + """
local consumer, count, read = ARGV[2], ARGV[3], 0
for i = 4, #ARGV do
  local priority = ARGV[i]
  local legacy = prefix .. ':queue:' .. priority
  if redis.call('EXISTS', legacy) == 1 then
    redis.call('SADD', queue_streams_key, legacy)  -- entries in flight there are reaped from there
    ensure_group(legacy)
    local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count, 'STREAMS', legacy, '>')
    for _, item in ipairs(reply and reply[1][2] or {}) do
      local entry, id = item[1], item[2][2]
      local status, team = unpack(redis.call('HMGET', job_key(id), 'status', 'team'))
      if status == 'queued' then enqueue(id, team, priority) end
      redis.call('XACK', legacy, group, entry)
      redis.call('XDEL', legacy, entry)
      read = read + 1
    end
  end
end
return read
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
local status, team, attempts, flagged, worker, priority = unpack(redis.call('HMGET', key, 'status', 'team',
  'attempts', 'cancel_requested', 'worker', 'priority'))
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
enqueue(id, team, priority)
redis.call('HSET', key, 'worker', '', 'lease_until', '')
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
    """The teams' streams, their consumer group and the turns between teams."""

    def __init__(
        self, redis: Redis, keys: Keys, policy: RetryPolicy | None = None, teams: TeamPolicies | None = None
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.policy = policy or RetryPolicy()
        self.lease_seconds = self.policy.lease_seconds
        self.max_attempts = self.policy.max_attempts
        self.dispatch = (
            [teams.default.weight, teams.default.running_jobs, teams.dispatch_table()] if teams else [1.0, 0, "{}"]
        )
        """Default weight, default running limit, and the teams that differ: what a claim needs."""
        self._claim = redis.register_script(_CLAIM)
        self._adopt = redis.register_script(_ADOPT)
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._reap = redis.register_script(_REAP)

    async def ensure_group(self, batch: int = 1000) -> int:
        """Move jobs still waiting in a priority's single stream of old into their teams' streams;
        returns how many entries were read. (Each team's stream gets its group when it is made.)"""
        moved = 0
        while read := await self._adopt(args=[self.keys.prefix, "adopt", batch, *PRIORITIES]):
            moved += int(read)
        return moved

    async def claim(self, worker: str, block_ms: int = 5000) -> Lease | None:
        """Take the next job (highest priority first, the teams in turn within one), waiting up to
        `block_ms`; None when there is none.

        Entries whose job was cancelled (or vanished) while queued are acknowledged and skipped.
        """
        deadline = time.monotonic() + block_ms / 1000
        while True:
            now = time.time()
            reply = await self._claim(
                args=[self.keys.prefix, worker, repr(now), repr(now + self.lease_seconds), *self.dispatch, *PRIORITIES]
            )
            if reply[0] == "running":
                _state, job_id, stream, entry, attempt = reply
                return Lease(job_id=job_id, worker=worker, stream=stream, entry=entry, attempt=int(attempt))
            if reply[0] == "again":
                continue
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            # From the newest signal the script saw: a job queued since then wakes the wait at once.
            signal = {self.keys.queue_signal(): reply[1]}
            await self.redis.xread(signal, count=1, block=min(remaining_ms, SIGNAL_WAIT_MS))

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

    async def streams(self) -> list[str]:
        """Every queue stream, sorted (teams' streams, and a priority's stream of old while it exists)."""
        return sorted(await self.redis.smembers(self.keys.queue_streams()))

    async def reap(self, janitor: str = "janitor") -> Counter[str]:
        """Re-deliver or fail every job whose lease expired; returns how many went which way."""
        outcomes: Counter[str] = Counter()
        min_idle_ms = self.lease_seconds * 1000
        for stream in await self.streams():
            start = "0-0"
            while True:
                try:
                    start, entries, *_deleted = await self.redis.xautoclaim(
                        stream, CONSUMER_GROUP, janitor, min_idle_ms, start_id=start, count=100
                    )
                except ResponseError as error:
                    if "NOGROUP" not in str(error):
                        raise
                    break  # Redis lost the group and so its leases; the next claim makes the group again
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

    async def waiting(self) -> dict[tuple[str, str], int]:
        """Jobs waiting for a worker (entries not yet delivered to the group), per (priority, team)."""
        streams = await self.streams()
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xlen(stream)
                pipe.xpending(stream, CONSUMER_GROUP)
            replies = await pipe.execute(raise_on_error=False)
        found: Counter[tuple[str, str]] = Counter()
        for stream, length, pending in zip(streams, replies[::2], replies[1::2], strict=True):
            if isinstance(length, Exception):
                raise length
            delivered = pending["pending"] if isinstance(pending, dict) else 0
            priority, team = self.keys.queue_of(stream)
            found[priority, team or ""] += max(0, int(length) - int(delivered))
        return dict(found)

    async def depth(self) -> dict[str, int]:
        """Jobs waiting for a worker, per priority."""
        depths = dict.fromkeys(PRIORITIES, 0)
        for (priority, _team), count in (await self.waiting()).items():
            if priority in depths:
                depths[priority] += count
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

"""The job store: job records in Redis, their per-team indexes, status transitions and events.

A record is a hash per job. Submission writes the record, the indexes, the queue entry and the
idempotency key in one Lua script (one round trip, all or nothing). Later changes go through the
same `set_status` Lua function, so the indexes, the counters and the event stream always agree
with the record. Workers use `update_progress` and `finish`; the queue module claims and re-delivers.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from redis.asyncio import Redis

from service.errors import IdempotencyConflict, JobNotFound, LeaseLost, QuotaExceeded
from service.ids import new_id
from service.keys import LUA_PRELUDE, Keys
from service.schemas import JOB_STATUSES, JobEvent, JobRecord, JobRequest, Progress
from service.teams import TeamPolicy, limit_source

_SUBMIT = (
    LUA_PRELUDE
    + """
local team, idem, mode, digest = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local ttl, now, n = ARGV[6], ARGV[7], tonumber(ARGV[8])
local max_queued, per_minute = tonumber(ARGV[9]), tonumber(ARGV[10])
local first = ARGV[11]
if idem ~= '' then
  local held = redis.call('GET', idem)
  if held then
    local sep = string.find(held, ' ', 1, true)
    local id, held_digest = string.sub(held, 1, sep - 1), string.sub(held, sep + 1)
    local status = redis.call('HGET', job_key(id), 'status')
    if mode == 'explicit' then
      if held_digest ~= digest then return {'conflict', id} end
      if status then return {'replayed', id} end
    elseif status and status ~= 'failed' and status ~= 'cancelled' then
      return {'replayed', id}
    end
  end
end
-- Quotas, checked in the same step as the write so concurrent submissions cannot pass them together.
if max_queued > 0 then
  local queued = redis.call('ZCARD', team_status_key(team, 'queued'))
  if queued + n > max_queued then return {'quota', 'queued_jobs', tostring(queued)} end
end
if per_minute > 0 then  -- a token bucket of per_minute tokens, refilled at per_minute a minute
  local bucket = prefix .. ':team:' .. team .. ':rate'
  local tokens, at = unpack(redis.call('HMGET', bucket, 'tokens', 'at'))
  tokens, at = tonumber(tokens) or per_minute, tonumber(at) or tonumber(now)
  tokens = math.min(per_minute, tokens + math.max(0, tonumber(now) - at) * per_minute / 60)
  if tokens < 1 then
    return {'quota', 'submissions_per_minute', tostring(math.ceil((1 - tokens) * 60 / per_minute))}
  end
  redis.call('HSET', bucket, 'tokens', tostring(tokens - 1), 'at', now)
  redis.call('EXPIRE', bucket, 120)
end
for i = 0, n - 1 do
  local id = ARGV[11 + 2 * i]
  local fields = cjson.decode(ARGV[12 + 2 * i])
  local flat = {}
  for field, value in pairs(fields) do
    flat[#flat + 1] = field
    flat[#flat + 1] = value
  end
  redis.call('HSET', job_key(id), unpack(flat))
  enqueue(id, team, fields['priority'])
  redis.call('ZADD', team_jobs_key(team), 0, id)
  set_status(id, team, false, 'queued', now, {attempts = 0})
end
if idem ~= '' then redis.call('SET', idem, first .. ' ' .. digest, 'EX', ttl) end
return {'created', first}
"""
)

_CANCEL = (
    LUA_PRELUDE
    + """
local id, team, now = ARGV[2], ARGV[3], ARGV[4]
local key = job_key(id)
local owner, status, flagged, stream, entry = unpack(redis.call('HMGET', key, 'team', 'status',
  'cancel_requested', 'stream', 'entry'))
if owner ~= team then return 'missing' end
if status == 'queued' then
  redis.call('XDEL', stream, entry)
  redis.call('HSET', key, 'cancel_requested', '1', 'finished_at', now)
  set_status(id, team, status, 'cancelled', now, {reason = 'cancelled before it started'})
  return 'cancelled'
end
if status == 'running' then
  if flagged ~= '1' then
    redis.call('HSET', key, 'cancel_requested', '1', 'updated_at', now)
    emit(id, 'cancel_requested', cjson.encode({at = tonumber(now)}))
  end
  return 'flagged'
end
return status
"""
)

_PROGRESS = (
    LUA_PRELUDE
    + """
local id, worker, now, progress = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local key = job_key(id)
local status, owner, flagged = unpack(redis.call('HMGET', key, 'status', 'worker', 'cancel_requested'))
if status ~= 'running' or owner ~= worker then return {'lost', '0'} end
redis.call('HSET', key, 'progress', progress, 'updated_at', now)
emit(id, 'progress', progress)
return {'running', flagged or '0'}
"""
)

_FINISH = (
    LUA_PRELUDE
    + """
local id, worker, now, new, error, kind = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local key = job_key(id)
local status, owner, team = unpack(redis.call('HMGET', key, 'status', 'worker', 'team'))
if status ~= 'running' or owner ~= worker then return 'lost' end
redis.call('HSET', key, 'finished_at', now, 'error', error, 'error_kind', kind)
local details = {}
if error ~= '' then details['error'] = error end
set_status(id, team, status, new, now, details)
return new
"""
)


RETRY_AFTER_QUEUED_SECONDS = 30
"""When to try again after the queued-jobs limit: about when some of the team's jobs have started."""


def quota_error(limit: str, detail: str, policy: TeamPolicy, jobs: int) -> QuotaExceeded:
    """The 429 of a submission the submit script refused, naming the limit and where it is set."""
    if limit == "queued_jobs":
        return QuotaExceeded(
            limit,
            f"your team has {detail} queued jobs; {jobs} more would pass its limit of {policy.queued_jobs} "
            f"(queued_jobs: {limit_source(limit)}). Retry once some have started, or cancel some",
            RETRY_AFTER_QUEUED_SECONDS,
        )
    return QuotaExceeded(
        limit,
        f"your team made its {policy.submissions_per_minute} submissions of the last minute "
        f"(submissions_per_minute: {limit_source(limit)}); retry in {detail} s",
        int(detail),
    )


@dataclass(frozen=True)
class Submission:
    record: JobRecord
    replayed: bool
    """True when an earlier submission with the same idempotency key (or body) was returned."""


@dataclass(frozen=True)
class Cancellation:
    record: JobRecord
    outcome: str
    """'cancelled' (it was queued and will never run), 'flagged' (a worker will stop it) or the
    terminal status it already had."""


def request_digest(request: JobRequest, *, with_priority: bool) -> str:
    """A stable hash of what a request asks for; priority changes when, not what, so it may be left out.

    The allocation is hashed as resolved, so naming the method's default and leaving it out are the
    same request; 'uniform' is left out, as requests were hashed before allocations were stored resolved."""
    body = request.model_dump(mode="json", by_alias=True, exclude={"priority"} if not with_priority else None)
    if body.get("allocation") == "uniform":
        del body["allocation"]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _time(value: str | None) -> datetime | None:
    return datetime.fromtimestamp(float(value), tz=timezone.utc) if value else None


def record_from_hash(fields: dict[str, str]) -> JobRecord:
    """The API view of a stored job hash."""
    return JobRecord(
        id=fields["id"],
        team=fields["team"],
        status=fields["status"],
        priority=fields["priority"],
        created_at=_time(fields["created_at"]),
        updated_at=_time(fields["updated_at"]),
        started_at=_time(fields.get("started_at")),
        finished_at=_time(fields.get("finished_at")),
        attempts=int(fields.get("attempts") or 0),
        progress=Progress.model_validate_json(fields["progress"]),
        error=fields.get("error") or None,
        error_kind=fields.get("error_kind") or None,
        cancel_requested=fields.get("cancel_requested") == "1",
        worker=fields.get("worker") or None,
        linked=json.loads(fields.get("linked") or "[]"),
        request=JobRequest.from_stored(fields["request"]),
    )


def events_from_reply(reply: list | None) -> list[JobEvent]:
    """The events of an XREAD reply, in stream order."""
    return [
        JobEvent(id=entry_id, type=fields["type"], data=json.loads(fields["data"]))
        for _stream, entries in reply or []
        for entry_id, fields in entries
    ]


class JobStore:
    """Job records of all teams in one Redis; every read is scoped to the caller's team."""

    def __init__(self, redis: Redis, keys: Keys, *, idempotency_ttl_seconds: int = 24 * 3600) -> None:
        self.redis = redis
        self.keys = keys
        self.idempotency_ttl_seconds = idempotency_ttl_seconds
        self._submit = redis.register_script(_SUBMIT)
        self._cancel = redis.register_script(_CANCEL)
        self._progress = redis.register_script(_PROGRESS)
        self._finish = redis.register_script(_FINISH)

    async def submit(
        self,
        team: str,
        request: JobRequest,
        idempotency_key: str | None = None,
        *,
        policy: TeamPolicy | None = None,
        rate_limited: bool = True,
    ) -> Submission:
        """Store and enqueue one job per keep ratio, or return the job an earlier identical submission made.

        Without an Idempotency-Key the request body itself is the key, except that a failed or
        cancelled job is not handed back: submitting it again is how one retries it. A replay is
        never refused; a new submission beyond the team's `policy` (its queued jobs, and unless not
        `rate_limited` its submissions a minute) raises QuotaExceeded and writes nothing.
        """
        now = time.time()
        if idempotency_key is not None:
            mode, digest = "explicit", request_digest(request, with_priority=True)
            key_digest = "key:" + hashlib.sha256(idempotency_key.encode()).hexdigest()
        else:
            mode, digest = "implicit", request_digest(request, with_priority=False)
            key_digest = "body:" + digest
        ratios = request.keep_ratios()
        ids = [new_id("job", now) for _ in ratios]
        args: list[Any] = [
            self.keys.prefix,
            team,
            self.keys.idempotency(team, key_digest),
            mode,
            digest,
            self.idempotency_ttl_seconds,
            repr(now),
            len(ids),
            policy.queued_jobs if policy else 0,
            policy.submissions_per_minute if policy and rate_limited else 0,
        ]
        stored = []
        for job_id, ratio in zip(ids, ratios, strict=True):
            fields = {
                "id": job_id,
                "team": team,
                "priority": request.priority,
                "created_at": repr(now),
                "attempts": "0",
                "cancel_requested": "0",
                "request": request.for_ratio(ratio).model_dump_json(by_alias=True),
                "progress": Progress().model_dump_json(),
                "linked": json.dumps([other for other in ids if other != job_id]),
            }
            args += [job_id, json.dumps(fields)]
            stored.append(fields)
        outcome, job_id, *detail = await self._submit(args=args)
        if outcome == "quota":  # job_id is the limit's name here
            assert policy is not None  # no limits, no refusal
            raise quota_error(job_id, detail[0], policy, len(ids))
        if outcome == "conflict":
            raise IdempotencyConflict(job_id)
        if outcome == "created":  # answer from what was written: no second round trip
            first = stored[0] | {"status": "queued", "updated_at": repr(now)}
            return Submission(record=record_from_hash(first), replayed=False)
        record = await self.get(team, job_id)
        if record is None:  # the job a replay points at expired or vanished; should not happen
            raise JobNotFound(job_id)
        return Submission(record=record, replayed=outcome == "replayed")

    async def get(self, team: str, job_id: str) -> JobRecord | None:
        """The job, or None when it does not exist or belongs to another team."""
        fields = await self.redis.hgetall(self.keys.job(job_id))
        if not fields or fields.get("team") != team:
            return None
        return record_from_hash(fields)

    async def claimed(self, job_id: str) -> JobRecord:
        """The record of a job a worker holds the lease of (no team check: the queue named it).

        Raises JobNotFound when the record is gone (deleted or expired while queued)."""
        fields = await self.redis.hgetall(self.keys.job(job_id))
        if not fields:
            raise JobNotFound(job_id)
        return record_from_hash(fields)

    async def require(self, team: str, job_id: str) -> JobRecord:
        record = await self.get(team, job_id)
        if record is None:
            raise JobNotFound(job_id)
        return record

    async def list(
        self, team: str, *, status: str | None = None, limit: int = 50, cursor: str | None = None
    ) -> tuple[list[JobRecord], str | None]:
        """A page of the team's jobs, newest first, and the cursor of the next page (None at the end)."""
        index = self.keys.team_status(team, status) if status else self.keys.team_jobs(team)
        upper = f"({cursor}" if cursor else "+"
        ids = await self.redis.zrevrangebylex(index, upper, "-", start=0, num=limit + 1)
        page, more = ids[:limit], len(ids) > limit
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in page:
                pipe.hgetall(self.keys.job(job_id))
            rows = await pipe.execute()
        records = [record_from_hash(row) for row in rows if row and row.get("team") == team]
        if status:  # a job may have moved on between the two reads
            records = [r for r in records if r.status == status]
        return records, (page[-1] if more else None)

    async def cancel(self, team: str, job_id: str) -> Cancellation:
        """Cancel a queued job outright; flag a running one so its worker stops between layers."""
        outcome = await self._cancel(args=[self.keys.prefix, job_id, team, repr(time.time())])
        if outcome == "missing":
            raise JobNotFound(job_id)
        return Cancellation(record=await self.require(team, job_id), outcome=outcome)

    async def update_progress(self, job_id: str, worker: str, progress: Progress) -> bool:
        """Publish a worker's progress. Returns whether the job should stop (cancel requested).

        Raises LeaseLost when the job is no longer this worker's (re-delivered, finished, gone).
        """
        state, flagged = await self._progress(
            args=[self.keys.prefix, job_id, worker, repr(time.time()), progress.model_dump_json()]
        )
        if state == "lost":
            raise LeaseLost(job_id, worker)
        return flagged == "1"

    async def finish(
        self, job_id: str, worker: str, status: str, error: str | None = None, error_kind: str | None = None
    ) -> None:
        """Move a running job to succeeded, failed (with a readable reason and its kind, see
        service/retry.py ERROR_KINDS) or cancelled."""
        if status not in ("succeeded", "failed", "cancelled"):
            raise ValueError(f"a job finishes as succeeded, failed or cancelled; got {status!r}")
        if status == "failed" and not error:
            raise ValueError("a failed job needs a reason the submitter can act on")
        outcome = await self._finish(
            args=[self.keys.prefix, job_id, worker, repr(time.time()), status, error or "", error_kind or ""]
        )
        if outcome == "lost":
            raise LeaseLost(job_id, worker)

    async def events(self, job_id: str, after: str = "0-0", block_ms: int | None = None) -> list[JobEvent]:
        """Events newer than `after` (at most 100), waiting up to `block_ms` for the first one when
        there are none. The API's event streams never block here: they share one reader (api/sse.py)."""
        reply = await self.redis.xread({self.keys.events(job_id): after}, count=100, block=block_ms)
        return events_from_reply(reply)

    async def team_counts(self, teams: list[str], statuses: tuple[str, ...]) -> dict[str, dict[str, int]]:
        """Jobs per team in each of `statuses`, read from the teams' status indexes in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for team in teams:
                for status in statuses:
                    pipe.zcard(self.keys.team_status(team, status))
            counts = iter(await pipe.execute())
        return {team: {status: int(next(counts)) for status in statuses} for team in teams}

    async def status_counts(self) -> dict[str, int]:
        """Jobs per status over all teams."""
        counts = await self.redis.hgetall(self.keys.stats())
        return {status: int(counts.get(status, 0)) for status in JOB_STATUSES}

"""The Redis key layout, in Python and in the Lua prelude that the atomic scripts share.

Every job-state change runs as one Lua script so that the record, the per-team indexes, the status
counters and the event stream can never disagree, whatever fails in between. The key names are
built in both languages, so they sit side by side here.

Layout under a prefix (default `ftc`):

    {p}:job:{id}                     hash    the job record
    {p}:job:{id}:events              stream  status and progress events (capped)
    {p}:team:{team}:jobs             zset    every job id of a team (score 0; ids sort by time)
    {p}:team:{team}:status:{status}  zset    the team's job ids in one status
    {p}:stats:status                 hash    jobs per status, over all teams
    {p}:idem:{team}:{digest}         string  "{job_id} {request digest}", expires
    {p}:queue:{priority}             stream  job ids waiting for a worker (one consumer group)
"""

from __future__ import annotations

from dataclasses import dataclass

from service.schemas import PRIORITIES

EVENTS_MAXLEN = 1000
"""Events kept per job; a job with more layers than this still ends with its final status event."""

CONSUMER_GROUP = "workers"


@dataclass(frozen=True)
class Keys:
    prefix: str = "ftc"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:events"

    def job_id_of_events(self, key: str) -> str:
        """The job whose event stream `key` is (the inverse of `events`)."""
        return key.removeprefix(f"{self.prefix}:job:").removesuffix(":events")

    def team_jobs(self, team: str) -> str:
        return f"{self.prefix}:team:{team}:jobs"

    def team_status(self, team: str, status: str) -> str:
        return f"{self.prefix}:team:{team}:status:{status}"

    def stats(self) -> str:
        return f"{self.prefix}:stats:status"

    def idempotency(self, team: str, digest: str) -> str:
        return f"{self.prefix}:idem:{team}:{digest}"

    def queue(self, priority: str) -> str:
        return f"{self.prefix}:queue:{priority}"

    def queues(self) -> list[str]:
        """The priority streams, highest first."""
        return [self.queue(p) for p in PRIORITIES]


LUA_PRELUDE = f"""
-- Shared by every script: ARGV[1] is the key prefix.
local prefix = ARGV[1]
local function job_key(id) return prefix .. ':job:' .. id end
local function events_key(id) return prefix .. ':job:' .. id .. ':events' end
local function team_jobs_key(team) return prefix .. ':team:' .. team .. ':jobs' end
local function team_status_key(team, status) return prefix .. ':team:' .. team .. ':status:' .. status end
local stats_key = prefix .. ':stats:status'

local function emit(id, kind, data)
  redis.call('XADD', events_key(id), 'MAXLEN', '~', {EVENTS_MAXLEN}, '*', 'type', kind, 'data', data)
end

-- The one way a job changes status: record, team index, counters and event move together.
local function set_status(id, team, old, new, now, details)
  redis.call('HSET', job_key(id), 'status', new, 'updated_at', now)
  if old then
    redis.call('ZREM', team_status_key(team, old), id)
    redis.call('HINCRBY', stats_key, old, -1)
  end
  redis.call('ZADD', team_status_key(team, new), 0, id)
  redis.call('HINCRBY', stats_key, new, 1)
  local event = details or {{}}
  event['status'] = new
  event['at'] = tonumber(now)
  emit(id, 'status', cjson.encode(event))
end
"""

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
    {p}:queue:{priority}:team:{team} stream  the team's job ids waiting for a worker (one consumer group)
    {p}:queue:{priority}:turns       zset    teams with jobs waiting at that priority, scored by their pass
    {p}:queue:{priority}:clock       string  the pass of the team served last (where a newcomer starts)
    {p}:queue:streams                set     every queue stream (the janitor and the metrics walk them)
    {p}:queue:signal                 stream  one entry per job queued, for idle workers to wait on (capped)
    {p}:team:{team}:rate             hash    the team's submission bucket: tokens left and when counted
    {p}:team:{team}:upload_bytes     string  bytes of the team's uploads
    {p}:team:{team}:streams          zset    the team's open event streams, scored by when they lapse
    {p}:queue:{priority}             stream  the one queue of a priority before fair dispatch (adopted)
    {p}:plan:{team}:{key}            string  the worker measuring a shared layer plan (a lease, expires)

Team names are `[a-z0-9_-]`, so `turns`, `clock` and `team:{team}` never meet.
"""

from __future__ import annotations

from dataclasses import dataclass

EVENTS_MAXLEN = 1000
"""Events kept per job; a job with more layers than this still ends with its final status event."""

CONSUMER_GROUP = "workers"

SIGNAL_MAXLEN = 100
"""Entries kept in the signal stream: idle workers only need its newest id."""


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

    def queue(self, priority: str, team: str) -> str:
        """The stream of one team's jobs at one priority."""
        return f"{self.prefix}:queue:{priority}:team:{team}"

    def queue_of(self, stream: str) -> tuple[str, str | None]:
        """(priority, team) of a queue stream; team None for a priority's shared stream of old."""
        rest = stream.removeprefix(f"{self.prefix}:queue:")
        priority, _, team = rest.partition(":team:")
        return priority, team or None

    def turns(self, priority: str) -> str:
        return f"{self.prefix}:queue:{priority}:turns"

    def queue_streams(self) -> str:
        return f"{self.prefix}:queue:streams"

    def queue_signal(self) -> str:
        return f"{self.prefix}:queue:signal"

    def legacy_queue(self, priority: str) -> str:
        """A priority's single stream, as queued before dispatch was fair; adopted by `Queue.ensure_group`."""
        return f"{self.prefix}:queue:{priority}"

    def rate(self, team: str) -> str:
        return f"{self.prefix}:team:{team}:rate"

    def upload_bytes(self, team: str) -> str:
        return f"{self.prefix}:team:{team}:upload_bytes"

    def streams(self, team: str) -> str:
        return f"{self.prefix}:team:{team}:streams"

    def plan_lease(self, team: str, key: str) -> str:
        """Held by the worker measuring the team's layer plan `key` (service/plans.py)."""
        return f"{self.prefix}:plan:{team}:{key}"


LUA_PRELUDE = f"""
-- Shared by every script: ARGV[1] is the key prefix.
local prefix = ARGV[1]
local function job_key(id) return prefix .. ':job:' .. id end
local function events_key(id) return prefix .. ':job:' .. id .. ':events' end
local function team_jobs_key(team) return prefix .. ':team:' .. team .. ':jobs' end
local function team_status_key(team, status) return prefix .. ':team:' .. team .. ':status:' .. status end
local stats_key = prefix .. ':stats:status'
local group = '{CONSUMER_GROUP}'
local function queue_key(priority, team) return prefix .. ':queue:' .. priority .. ':team:' .. team end
local function turns_key(priority) return prefix .. ':queue:' .. priority .. ':turns' end
local function clock_key(priority) return prefix .. ':queue:' .. priority .. ':clock' end
local queue_streams_key = prefix .. ':queue:streams'
local signal_key = prefix .. ':queue:signal'

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

-- Create the consumer group of a stream (and the stream) unless it has one.
local function ensure_group(stream)
  redis.pcall('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
end

-- Put a job at the back of its team's stream for its priority. A team that had no turn gets one at
-- the pass of the team served last, so it is next, not first by a debt it ran up while idle.
local function enqueue(id, team, priority)
  local stream = queue_key(priority, team)
  if redis.call('SADD', queue_streams_key, stream) == 1 or redis.call('EXISTS', stream) == 0 then
    ensure_group(stream)
  end
  local entry = redis.call('XADD', stream, '*', 'job', id)
  redis.call('HSET', job_key(id), 'stream', stream, 'entry', entry)
  redis.call('ZADD', turns_key(priority), 'GT', redis.call('GET', clock_key(priority)) or '0', team)
  redis.call('XADD', signal_key, 'MAXLEN', '~', {SIGNAL_MAXLEN}, '*', 'priority', priority)
  return entry
end
"""

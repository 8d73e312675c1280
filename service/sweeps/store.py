"""The sweep store: campaigns and their runs in Redis, expanded into jobs through the job store.

A run is written first as a plan (its cells, no job ids yet) in the same atomic step that creates
the sweep or fires its cron slot; then `expand` submits one linked job set per model x variant
through `JobStore.submit`, with an idempotency key per set, and records each set's job ids in a
field of its own (`jobs:{set}`). A run whose expansion was interrupted stays in the open set and is
finished by the next `expand` (the scheduler retries open runs); the idempotency keys make a second
submission return the jobs of the first, so two expanders at once (the API and the scheduler) write
the same ids. Cell statuses are always read from the jobs themselves.

A run's jobs count against its team's queued-jobs quota like any other: `expand` submits job sets
while they fit and leaves the rest for a later pass (the scheduler retries open runs), so a large
run fills the queue as room frees up instead of failing. A team holds at most its `sweeps` quota of
live sweeps (scheduled, or with a run still open): `{p}:team:{team}:sweeps:live`.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from redis.asyncio import Redis

from service.errors import QuotaExceeded
from service.ids import new_id
from service.jobs import JobStore
from service.schemas import TERMINAL_STATUSES, Progress
from service.sweeps.cron import next_slot
from service.sweeps.expand import PlannedCell, idempotency_key, job_sets, plan_cells
from service.sweeps.keys import SweepKeys
from service.sweeps.schemas import (
    RunReport,
    SweepCell,
    SweepRecord,
    SweepRequest,
    SweepRun,
    SweepRunDetail,
    SweepSummary,
)
from service.sweeps.status import counts, run_status
from service.teams import TeamPolicies, limit_source

RETRY_AFTER_SWEEPS_SECONDS = 60
"""When to try again after the sweeps quota: a live one-off sweep stops counting when its run ends."""

SLOT_MARKER_SECONDS = 35 * 24 * 3600
"""How long a fired slot is remembered; longer than any schedule's gap between two slots."""

RUNS_SHOWN = 20

_ADD_RUN = """
local function hset_json(key, encoded)
  local flat = {}
  for field, value in pairs(cjson.decode(encoded)) do
    flat[#flat + 1] = field
    flat[#flat + 1] = value
  end
  redis.call('HSET', key, unpack(flat))
end

-- A planned run: its record, its place in the sweep's run list, and the open set the scheduler walks.
local function add_run(sweep_key, runs_key, run_key, open_key, sweep_id, run_id, run_fields, now)
  hset_json(run_key, run_fields)
  redis.call('RPUSH', runs_key, run_id)
  redis.call('SADD', open_key, sweep_id .. '/' .. run_id)
  redis.call('HSET', sweep_key, 'updated_at', now)
end
"""

_CREATE = (
    _ADD_RUN
    + """
local sweep_key, team_key, scheduled_key, runs_key, run_key, open_key, live_key = unpack(KEYS)
local sweep_id, sweep_fields, first_slot, run_id, run_fields, now, most = unpack(ARGV)
if redis.call('EXISTS', sweep_key) == 1 then return 'exists' end
if tonumber(most) > 0 and redis.call('SCARD', live_key) >= tonumber(most) then return 'quota' end
hset_json(sweep_key, sweep_fields)
redis.call('ZADD', team_key, 0, sweep_id)
redis.call('SADD', live_key, sweep_id)
if first_slot ~= '' then redis.call('ZADD', scheduled_key, first_slot, sweep_id) end
if run_id ~= '' then add_run(sweep_key, runs_key, run_key, open_key, sweep_id, run_id, run_fields, now) end
return 'created'
"""
)

_START = (
    _ADD_RUN
    + """
local sweep_key, runs_key, run_key, open_key, scheduled_key, live_key, marker_key = KEYS[1], KEYS[2], KEYS[3],
  KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local sweep_id, run_id, run_fields, now, following_slot, marker_seconds, most = unpack(ARGV)
if redis.call('EXISTS', sweep_key) == 0 then return {'missing', ''} end
if redis.call('HEXISTS', sweep_key, 'cancelled_at') == 1 then
  redis.call('ZREM', scheduled_key, sweep_id)
  return {'cancelled', ''}
end
if redis.call('SISMEMBER', live_key, sweep_id) == 0 then  -- a finished one-off sweep run again is live again
  if tonumber(most) > 0 and redis.call('SCARD', live_key) >= tonumber(most) then return {'quota', ''} end
  redis.call('SADD', live_key, sweep_id)
end
if following_slot ~= '' then redis.call('ZADD', scheduled_key, 'GT', following_slot, sweep_id) end
if marker_key then
  if not redis.call('SET', marker_key, run_id, 'NX', 'EX', marker_seconds) then
    return {'taken', redis.call('GET', marker_key)}
  end
end
add_run(sweep_key, runs_key, run_key, open_key, sweep_id, run_id, run_fields, now)
return {'started', run_id}
"""
)


class SweepCancelled(Exception):
    """A cancelled campaign gets no more runs."""

    def __init__(self, sweep_id: str) -> None:
        super().__init__(f"sweep {sweep_id} was cancelled; create a new sweep to run the campaign again")
        self.sweep_id = sweep_id


@dataclass(frozen=True)
class JobState:
    status: str
    progress: Progress
    error: str | None
    started_at: float | None
    finished_at: float | None


def unsubmitted(cancelled: bool) -> JobState | None:
    """The state of a cell that has no job yet: waiting, or never to run once the sweep is cancelled."""
    if not cancelled:
        return None
    return JobState("cancelled", Progress(), "the sweep was cancelled before this cell was submitted", None, None)


@dataclass(frozen=True)
class RunCell:
    """A planned cell with its job's current state (None while the cell has no job yet)."""

    planned: PlannedCell
    state: JobState | None

    @property
    def status(self) -> str:
        return self.state.status if self.state else "queued"


@dataclass(frozen=True)
class RunContext:
    """Everything the report of one run needs, read from Redis."""

    team: str
    sweep_id: str
    run_id: str
    request: SweepRequest
    trigger: str
    created_at: float
    cancelled: bool
    cells: list[RunCell]
    previous_run: str | None

    @property
    def status(self) -> str:
        return run_status((c.status for c in self.cells), self.cancelled)

    @property
    def ended(self) -> bool:
        return all(c.status in TERMINAL_STATUSES for c in self.cells)


def _jobs_field(group: int) -> str:
    return f"jobs:{group}"


def planned_cells(run: dict[str, str]) -> list[PlannedCell]:
    """A run's cells, with the job ids of the sets submitted so far."""
    cells = [PlannedCell.from_json(c) for c in json.loads(run.get("cells") or "[]")]
    submitted = {c.group: json.loads(run[_jobs_field(c.group)]) for c in cells if _jobs_field(c.group) in run}
    filled, seen = [], Counter()
    for cell in cells:  # a set's cells are in its ratio order, which is the order of its job ids
        job_ids = submitted.get(cell.group)
        filled.append(dataclasses.replace(cell, job_id=job_ids[seen[cell.group]]) if job_ids else cell)
        seen[cell.group] += 1
    return filled


def _time(value: str | None) -> datetime | None:
    return datetime.fromtimestamp(float(value), tz=timezone.utc) if value else None


def _seconds(value: str | None) -> float | None:
    return float(value) if value else None


class SweepStore:
    """Sweeps of all teams in one Redis; reads and cancellations are scoped to the caller's team."""

    def __init__(
        self, redis: Redis, jobs: JobStore, keys: SweepKeys | None = None, teams: TeamPolicies | None = None
    ) -> None:
        self.redis = redis
        self.jobs = jobs
        self.keys = keys or SweepKeys(jobs.keys.prefix)
        self.teams = teams
        """Each team's quotas: queued jobs while expanding, live sweeps when creating; None: no limits."""
        self._create = redis.register_script(_CREATE)
        self._start = redis.register_script(_START)

    # --- writing --------------------------------------------------------------------------------

    async def create(self, team: str, request: SweepRequest, now: float) -> str:
        """Store the campaign; without a schedule its first run is planned in the same step and expanded."""
        sweep_id = new_id("swp", now)
        fields = {
            "id": sweep_id,
            "team": team,
            "request": request.model_dump_json(by_alias=True),
            "created_at": repr(now),
            "updated_at": repr(now),
        }
        first_slot = "" if request.schedule is None else repr(next_slot(request.schedule, request.timezone, now))
        run_id, run_fields = ("", "{}") if request.schedule else self._planned_run(team, request, "create", now)
        keys = self.keys
        outcome = await self._create(
            keys=[
                keys.sweep(sweep_id),
                keys.team_sweeps(team),
                keys.scheduled(),
                keys.runs(sweep_id),
                keys.run(sweep_id, run_id),
                keys.open_runs(),
                keys.live_sweeps(team),
            ],
            args=[sweep_id, json.dumps(fields), first_slot, run_id, run_fields, repr(now), self._most_sweeps(team)],
        )
        if outcome == "quota":
            raise self._sweeps_refused(team)
        if run_id:
            await self.expand(sweep_id, run_id)
        return sweep_id

    def _planned_run(
        self, team: str, request: SweepRequest, trigger: str, now: float, slot: float | None = None
    ) -> tuple[str, str]:
        run_id = new_id("run", now)
        fields = {
            "id": run_id,
            "team": team,
            "trigger": trigger,
            "slot": "" if slot is None else repr(slot),
            "created_at": repr(now),
            "state": "expanding",
            "cells": json.dumps([cell.to_json() for cell in plan_cells(request)]),
        }
        return run_id, json.dumps(fields)

    async def start_run(
        self,
        team: str,
        sweep_id: str,
        now: float,
        *,
        trigger: str = "manual",
        slot: float | None = None,
        following_slot: float | None = None,
    ) -> str | None:
        """Plan and expand a run. A cron `slot` fires at most once (None when it already fired), and
        moves the sweep's next slot to `following_slot`. Raises SweepCancelled for a cancelled sweep."""
        fields = await self.redis.hgetall(self.keys.sweep(sweep_id))
        if not fields or fields["team"] != team:
            raise KeyError(sweep_id)
        request = SweepRequest.from_stored(fields["request"])
        run_id, run_fields = self._planned_run(team, request, trigger, now, slot)
        keys = [
            self.keys.sweep(sweep_id),
            self.keys.runs(sweep_id),
            self.keys.run(sweep_id, run_id),
            self.keys.open_runs(),
            self.keys.scheduled(),
            self.keys.live_sweeps(team),
        ]
        if slot is not None:
            keys.append(self.keys.slot(sweep_id, slot))
        following = "" if following_slot is None else repr(following_slot)
        outcome, _run = await self._start(
            keys=keys,
            args=[sweep_id, run_id, run_fields, repr(now), following, SLOT_MARKER_SECONDS, self._most_sweeps(team)],
        )
        if outcome == "cancelled":
            raise SweepCancelled(sweep_id)
        if outcome == "quota":
            raise self._sweeps_refused(team)
        if outcome == "missing":
            raise KeyError(sweep_id)
        if outcome == "taken":
            return None
        await self.expand(sweep_id, run_id)
        return run_id

    def _most_sweeps(self, team: str) -> int:
        return self.teams.of(team).sweeps if self.teams else 0

    def _sweeps_refused(self, team: str) -> QuotaExceeded:
        most = self._most_sweeps(team)
        return QuotaExceeded(
            "sweeps",
            f"your team has {most} live sweeps (scheduled, or with a run under way), its limit (sweeps: "
            f"{limit_source('sweeps')}); cancel one, or retry when a run has ended",
            RETRY_AFTER_SWEEPS_SECONDS,
        )

    async def expand(self, sweep_id: str, run_id: str) -> None:
        """Submit the run's job sets that have no jobs yet, as long as they fit the team's queued-jobs
        quota (the rest on a later call); safe to repeat and to run concurrently."""
        sweep = await self.redis.hgetall(self.keys.sweep(sweep_id))
        run_key = self.keys.run(sweep_id, run_id)
        run = await self.redis.hgetall(run_key)
        if not sweep or not run or run.get("state") != "expanding":
            return
        team, request = sweep["team"], SweepRequest.from_stored(sweep["request"])
        cells = planned_cells(run)
        sets = job_sets(request)
        for group in sorted({c.group for c in cells if c.job_id is None}):
            if await self.redis.hexists(self.keys.sweep(sweep_id), "cancelled_at"):
                break
            policy = self.teams.of(team) if self.teams else None
            try:
                submission = await self.jobs.submit(
                    team, sets[group], idempotency_key(sweep_id, run_id, group), policy=policy, rate_limited=False
                )
            except QuotaExceeded:  # the queue is full for this team: the rest waits for room
                break
            # Saved per set, so an interrupted expansion resumes where it stopped.
            job_ids = [submission.record.id, *submission.record.linked]
            await self.redis.hset(run_key, _jobs_field(group), json.dumps(job_ids))
        cells = planned_cells(await self.redis.hgetall(run_key))
        if all(c.job_id for c in cells):
            await self.redis.hset(run_key, "state", "open")
        if await self.redis.hexists(self.keys.sweep(sweep_id), "cancelled_at"):
            await self._cancel_jobs(team, [c.job_id for c in cells if c.job_id])

    async def cancel(self, team: str, sweep_id: str, now: float) -> bool:
        """Stop the campaign: no further runs, and every unfinished job of its open runs is cancelled.
        Returns False when there is no such sweep for this team. Cancelling twice is harmless."""
        sweep_key = self.keys.sweep(sweep_id)
        fields = await self.redis.hgetall(sweep_key)
        if not fields or fields["team"] != team:
            return False
        if "cancelled_at" not in fields:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(sweep_key, mapping={"cancelled_at": repr(now), "updated_at": repr(now)})
                pipe.zrem(self.keys.scheduled(), sweep_id)
                pipe.srem(self.keys.live_sweeps(team), sweep_id)
                await pipe.execute()
        for open_sweep, run_id in await self.open_runs():
            if open_sweep == sweep_id:
                cells = planned_cells(await self.redis.hgetall(self.keys.run(sweep_id, run_id)))
                await self._cancel_jobs(team, [c.job_id for c in cells if c.job_id])
        return True

    async def _cancel_jobs(self, team: str, job_ids: list[str]) -> None:
        states = await self._job_states(job_ids)
        for job_id in job_ids:
            state = states.get(job_id)
            if state is not None and state.status not in TERMINAL_STATUSES:
                await self.jobs.cancel(team, job_id)

    async def finish_run(
        self, sweep_id: str, run_id: str, status: str, cell_counts: dict[str, int], report: RunReport, now: float
    ) -> None:
        """Freeze how the run ended, with its report, and take it off the open set; a sweep without a
        schedule and without another open run is no longer live."""
        sweep = await self.redis.hgetall(self.keys.sweep(sweep_id))
        request = SweepRequest.from_stored(sweep["request"]) if sweep else None
        others_open = any(s == sweep_id and r != run_id for s, r in await self.open_runs())
        async with self.redis.pipeline(transaction=True) as pipe:
            if request is not None and request.schedule is None and not others_open:
                pipe.srem(self.keys.live_sweeps(sweep["team"]), sweep_id)
            pipe.hset(
                self.keys.run(sweep_id, run_id),
                mapping={
                    "state": "finished",
                    "status": status,
                    "counts": json.dumps(cell_counts),
                    "finished_at": repr(now),
                    "report": report.model_dump_json(),
                },
            )
            pipe.hset(self.keys.sweep(sweep_id), "updated_at", repr(now))
            pipe.srem(self.keys.open_runs(), f"{sweep_id}/{run_id}")
            await pipe.execute()

    # --- what the scheduler walks ---------------------------------------------------------------

    async def due(self, now: float) -> list[tuple[str, float]]:
        """(sweep id, first unfired slot) of every scheduled sweep with a slot at or before `now`."""
        return await self.redis.zrangebyscore(self.keys.scheduled(), "-inf", now, withscores=True)

    async def open_runs(self) -> list[tuple[str, str]]:
        members = await self.redis.smembers(self.keys.open_runs())
        return sorted(tuple(m.split("/", 1)) for m in members)  # type: ignore[misc]

    async def sweep_fields(self, sweep_id: str) -> dict[str, str]:
        return await self.redis.hgetall(self.keys.sweep(sweep_id))

    async def run_context(self, sweep_id: str, run_id: str) -> RunContext | None:
        sweep = await self.redis.hgetall(self.keys.sweep(sweep_id))
        run = await self.redis.hgetall(self.keys.run(sweep_id, run_id))
        if not sweep or not run:
            return None
        cells = planned_cells(run)
        states = await self._job_states([c.job_id for c in cells if c.job_id])
        cancelled = "cancelled_at" in sweep
        return RunContext(
            team=sweep["team"],
            sweep_id=sweep_id,
            run_id=run_id,
            request=SweepRequest.from_stored(sweep["request"]),
            trigger=run["trigger"],
            created_at=float(run["created_at"]),
            cancelled=cancelled,
            cells=[RunCell(c, states.get(c.job_id) if c.job_id else unsubmitted(cancelled)) for c in cells],
            previous_run=await self._previous_reported_run(sweep_id, run_id),
        )

    async def _previous_reported_run(self, sweep_id: str, run_id: str) -> str | None:
        run_ids = await self.redis.lrange(self.keys.runs(sweep_id), 0, -1)
        earlier = run_ids[: run_ids.index(run_id)] if run_id in run_ids else run_ids
        for candidate in reversed(earlier):
            if await self.redis.hexists(self.keys.run(sweep_id, candidate), "report"):
                return candidate
        return None

    # --- reading --------------------------------------------------------------------------------

    async def _job_states(self, job_ids: list[str]) -> dict[str, JobState]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self.jobs.keys.job(job_id), "status", "progress", "error", "started_at", "finished_at")
            rows = await pipe.execute()
        states = {}
        for job_id, (status, progress, error, started, finished) in zip(job_ids, rows, strict=True):
            if status is not None:
                states[job_id] = JobState(
                    status=status,
                    progress=Progress.model_validate_json(progress) if progress else Progress(),
                    error=error or None,
                    started_at=_seconds(started),
                    finished_at=_seconds(finished),
                )
        return states

    async def get(self, team: str, sweep_id: str, run_id: str | None = None) -> SweepRecord | None:
        """The sweep with its recent runs and one run's cells (the latest, or `run_id`); None when
        there is no such sweep for this team, or it has no run `run_id`."""
        fields = await self.redis.hgetall(self.keys.sweep(sweep_id))
        if not fields or fields["team"] != team:
            return None
        run_ids = await self.redis.lrange(self.keys.runs(sweep_id), 0, -1)
        if run_id is not None and run_id not in run_ids:
            return None
        recent = list(reversed(run_ids[-RUNS_SHOWN:]))
        chosen = run_id or (recent[0] if recent else None)
        wanted = recent if chosen is None or chosen in recent else [*recent, chosen]
        runs = {run.id: (run, cells) for run, cells in await self._runs(sweep_id, wanted, fields, detailed=chosen)}
        summary = await self._summary(fields, runs[recent[0]][0] if recent else None, len(run_ids))
        detail = None
        if chosen is not None:
            run, cells = runs[chosen]
            detail = SweepRunDetail(**dict(run), cells=cells)
        return SweepRecord(
            **dict(summary),
            request=SweepRequest.from_stored(fields["request"]),
            runs=[runs[run_id][0] for run_id in recent],
            run=detail,
        )

    async def list(
        self, team: str, *, limit: int = 20, cursor: str | None = None
    ) -> tuple[list[SweepSummary], str | None]:
        """A page of the team's sweeps, newest first, and the cursor of the next page."""
        upper = f"({cursor}" if cursor else "+"
        ids = await self.redis.zrevrangebylex(self.keys.team_sweeps(team), upper, "-", start=0, num=limit + 1)
        page, more = ids[:limit], len(ids) > limit
        summaries = []
        for sweep_id in page:
            fields = await self.redis.hgetall(self.keys.sweep(sweep_id))
            if not fields or fields["team"] != team:
                continue
            latest = await self.redis.lrange(self.keys.runs(sweep_id), -1, -1)
            runs = await self._runs(sweep_id, latest, fields)
            total = await self.redis.llen(self.keys.runs(sweep_id))
            summaries.append(await self._summary(fields, runs[0][0] if runs else None, total))
        return summaries, (page[-1] if more else None)

    async def _summary(self, fields: dict[str, str], latest: SweepRun | None, runs_total: int) -> SweepSummary:
        request = SweepRequest.from_stored(fields["request"])
        cancelled = "cancelled_at" in fields
        if cancelled:
            status = "cancelled"
        else:
            status = latest.status if latest is not None else "scheduled"
        next_at = None if cancelled else await self.redis.zscore(self.keys.scheduled(), fields["id"])
        return SweepSummary(
            id=fields["id"],
            team=fields["team"],
            name=request.name,
            status=status,
            created_at=_time(fields["created_at"]),
            updated_at=_time(fields["updated_at"]),
            schedule=request.schedule,
            timezone=request.timezone,
            next_run_at=_time(repr(next_at)) if next_at is not None else None,
            cancelled_at=_time(fields.get("cancelled_at")),
            runs_total=runs_total,
            latest_run=latest,
        )

    async def _runs(
        self, sweep_id: str, run_ids: list[str], sweep: dict[str, str], detailed: str | None = None
    ) -> list[tuple[SweepRun, list[SweepCell]]]:
        """Each run's summary, and the cells of open runs and of the `detailed` one. A finished run
        says how it ended; an open one asks its jobs."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in run_ids:
                pipe.hgetall(self.keys.run(sweep_id, run_id))
            rows = [row for row in await pipe.execute() if row]
        live = [row for row in rows if row.get("state") != "finished" or row["id"] == detailed]
        planned = {row["id"]: planned_cells(row) for row in live}
        states = await self._job_states([c.job_id for cells in planned.values() for c in cells if c.job_id])
        cancelled = "cancelled_at" in sweep
        found = []
        for row in rows:
            cells = [
                _cell(c, states.get(c.job_id) if c.job_id else unsubmitted(cancelled))
                for c in planned.get(row["id"], [])
            ]
            statuses = [c.status for c in cells]
            finished = row.get("state") == "finished"
            run = SweepRun(
                id=row["id"],
                trigger=row["trigger"],
                slot=_time(row.get("slot")),
                created_at=_time(row["created_at"]),
                finished_at=_time(row.get("finished_at")),
                status=row["status"] if finished else run_status(statuses, cancelled),
                counts=json.loads(row["counts"]) if finished else counts(statuses),
                report=RunReport.model_validate_json(row["report"]) if row.get("report") else None,
            )
            found.append((run, cells))
        return found


def _cell(planned: PlannedCell, state: JobState | None) -> SweepCell:
    extra: dict[str, Any] = {}
    if state is not None:
        extra = {"status": state.status, "progress": state.progress, "error": state.error}
    return SweepCell(
        job_id=planned.job_id,
        model=planned.model,
        method=planned.method,
        ablate=list(planned.ablate),
        ratio=planned.ratio,
        dense_reference=planned.dense_reference,
        **extra,
    )

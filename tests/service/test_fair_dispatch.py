"""Fair dispatch against a real redis-server: within a priority, teams with waiting jobs are served
in turn (or by their weights), whatever one of them queued; every step is a claim, never a timer."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from service.jobs import JobStore
from service.keys import CONSUMER_GROUP
from service.queue import Queue
from service.retry import RetryPolicy
from service.runtime import Services
from service.schemas import JobRequest
from service.settings import Settings
from tests.support.service import JOB_REQUEST, run_async

RATIOS = [round(0.01 * (n + 1), 2) for n in range(32)]
"""The most ratios one submission takes: 32 linked jobs a call, so 2,000 jobs take 63 calls."""


def request(seed: int, **changes: Any) -> JobRequest:
    body = {**JOB_REQUEST, "calibration": {**JOB_REQUEST["calibration"], "seed": seed},
            "allocation": "uniform", **changes}  # RATIOS go below the default plan's smallest, 0.1
    if "ratios" in changes:
        del body["ratio"]
    return JobRequest.model_validate(body)


async def queue_jobs(jobs: JobStore, team: str, count: int, first_seed: int = 0, **changes: Any) -> list[str]:
    """`count` queued jobs of `team`, in submission order, 32 to a call."""
    ids: list[str] = []
    seed = first_seed
    while len(ids) < count:
        ratios = RATIOS[: min(32, count - len(ids))]
        body = changes | ({"ratios": ratios} if len(ratios) > 1 else {"ratio": ratios[0]})
        record = (await jobs.submit(team, request(seed, **body))).record
        ids += [record.id, *record.linked]
        seed += 1
    return ids


async def claims(queue: Queue, count: int, workers: tuple[str, ...] = ("w1", "w2")) -> list[str]:
    """The jobs of the next `count` claims, the workers taking turns (two workers by default)."""
    taken = []
    for n in range(count):
        lease = await queue.claim(workers[n % len(workers)], block_ms=0)
        assert lease is not None, f"claim {n + 1} of {count} found nothing"
        taken.append(lease.job_id)
    return taken


async def teams_of(services: Services, job_ids: list[str]) -> list[str]:
    return [await services.redis.hget(services.jobs.keys.job(job_id), "team") for job_id in job_ids]


@pytest.fixture
def make_settings(service_settings: Callable[..., Settings]) -> Callable[..., Settings]:
    def make(teams: dict[str, dict] | None = None) -> Settings:
        return service_settings(teams=json.dumps(teams or {}))

    return make


def test_one_job_of_team_b_is_claimed_next_behind_2000_of_team_a(make_settings) -> None:
    async def work(s: Services) -> None:
        a_jobs = await queue_jobs(s.jobs, "team-a", 2000)
        assert len(a_jobs) == 2000
        assert await claims(s.queue, 2) == a_jobs[:2]  # two workers busy with A's oldest
        [b_job] = await queue_jobs(s.jobs, "team-b", 1)
        assert await claims(s.queue, 1) == [b_job]  # the next free worker takes B's job
        assert await claims(s.queue, 3) == a_jobs[2:5]  # then A's, in A's own order
        assert (await s.queue.waiting())["normal", "team-a"] == 2000 - 5

    run_async(make_settings(), work)


def test_teams_with_waiting_jobs_take_turns_and_weights_share_the_claims(make_settings) -> None:
    async def work(s: Services) -> None:
        await queue_jobs(s.jobs, "team-a", 40)
        await queue_jobs(s.jobs, "team-b", 40)
        served = await teams_of(s, await claims(s.queue, 20))
        assert Counter(served) == {"team-a": 15, "team-b": 5}  # weights 3 : 1
        a, b = "team-a", "team-b"
        assert served[:10] == [a, b, a, a, a, b, a, a, a, b]  # equal passes go by team name

    run_async(make_settings({"team-a": {"weight": 3}}), work)


def test_a_team_that_starts_waiting_is_served_in_turn_not_first_by_its_idle_time(make_settings) -> None:
    async def work(s: Services) -> None:
        await queue_jobs(s.jobs, "team-a", 40)
        await claims(s.queue, 10)  # team-b was idle all along
        await queue_jobs(s.jobs, "team-b", 3, first_seed=100)
        served = await teams_of(s, await claims(s.queue, 6))
        assert served == ["team-b", "team-a"] * 3

    run_async(make_settings(), work)


def test_a_team_at_its_running_limit_is_passed_over_until_one_of_its_jobs_ends(make_settings) -> None:
    async def work(s: Services) -> None:
        a_jobs = await queue_jobs(s.jobs, "team-a", 5)
        b_jobs = await queue_jobs(s.jobs, "team-b", 5, first_seed=100)
        first, *others = await claims(s.queue, 4)
        assert first == a_jobs[0] and others == b_jobs[:3]  # A runs one job at most
        await s.jobs.finish(first, "w1", "succeeded")
        assert await claims(s.queue, 1) == [a_jobs[1]]  # A's turn again, now that it runs none

    run_async(make_settings({"team-a": {"running_jobs": 1}}), work)


def test_priorities_keep_their_meaning_across_teams(make_settings) -> None:
    async def work(s: Services) -> None:
        a_jobs = await queue_jobs(s.jobs, "team-a", 3)
        [b_low] = await queue_jobs(s.jobs, "team-b", 1, first_seed=100, priority="low")
        [b_high] = await queue_jobs(s.jobs, "team-b", 1, first_seed=200, priority="high")
        assert await claims(s.queue, 5) == [b_high, *a_jobs, b_low]

    run_async(make_settings(), work)


def test_a_lost_workers_job_goes_back_to_its_teams_turn(make_settings) -> None:
    async def work(s: Services) -> None:
        queue = Queue(s.redis, s.jobs.keys, RetryPolicy(lease_seconds=1), s.teams)
        [a_job] = await queue_jobs(s.jobs, "team-a", 1)
        b_jobs = await queue_jobs(s.jobs, "team-b", 2, first_seed=100)
        assert await claims(queue, 2) == [a_job, b_jobs[0]]
        await asyncio.sleep(1.2)  # both workers go silent past their lease
        assert await queue.reap() == {"requeued": 2}
        again = await claims(queue, 3, workers=("w3",))
        assert again == [a_job, b_jobs[1], b_jobs[0]]  # A's turn first, then B's jobs in B's order
        record = await s.jobs.require("team-a", a_job)
        assert (record.status, record.attempts, record.worker) == ("running", 2, "w3")

    run_async(make_settings(), work)


def test_jobs_queued_before_fair_dispatch_are_adopted_and_still_redelivered(make_settings) -> None:
    async def work(s: Services) -> None:
        keys = s.jobs.keys
        legacy = keys.legacy_queue("normal")  # the single stream of a priority, as queued before
        await s.redis.xgroup_create(legacy, CONSUMER_GROUP, id="0", mkstream=True)
        in_flight, waiting = await queue_jobs(s.jobs, "team-a", 2)
        for job_id in (in_flight, waiting):
            fields = await s.redis.hgetall(keys.job(job_id))
            await s.redis.xdel(fields["stream"], fields["entry"])
            entry = await s.redis.xadd(legacy, {"job": job_id})
            await s.redis.hset(keys.job(job_id), mapping={"stream": legacy, "entry": entry})
        await s.redis.xreadgroup(CONSUMER_GROUP, "old-worker", {legacy: ">"}, count=1)  # in_flight
        await s.redis.hset(keys.job(in_flight), mapping={"status": "running", "worker": "old-worker"})

        assert await s.queue.ensure_group() == 1  # the entry never delivered moves to its team's stream
        assert (await s.queue.claim("w1", block_ms=0)).job_id == waiting
        queue = Queue(s.redis, keys, RetryPolicy(lease_seconds=1), s.teams)
        await asyncio.sleep(1.2)  # neither the old worker nor w1 renews its lease
        assert await queue.reap() == {"requeued": 2}
        assert await s.redis.xlen(legacy) == 0
        assert await claims(queue, 2) == [in_flight, waiting]
        assert await s.redis.hget(keys.job(in_flight), "stream") == keys.queue("normal", "team-a")

    run_async(make_settings(), work)

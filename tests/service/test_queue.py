"""The queue against a real redis-server: priority claims, leases, heartbeats and the janitor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from service.errors import LeaseLost
from service.jobs import JobStore
from service.queue import Queue, run_janitor
from service.retry import RetryPolicy
from service.runtime import Services
from service.schemas import JobRequest, Progress
from service.settings import Settings
from tests.support.service import JOB_REQUEST, run_async

LEASE_SECONDS = 1


@pytest.fixture
def settings(service_settings: Callable[..., Settings]) -> Settings:
    return service_settings()


def short_lease_queue(services: Services, max_attempts: int = 3) -> Queue:
    policy = RetryPolicy(lease_seconds=LEASE_SECONDS, max_attempts=max_attempts)
    return Queue(services.redis, services.jobs.keys, policy)


async def submit(jobs: JobStore, seed: int = 0, **changes: Any) -> str:
    body = {**JOB_REQUEST, "calibration": {**JOB_REQUEST["calibration"], "seed": seed}, **changes}
    return (await jobs.submit("team-a", JobRequest.model_validate(body))).record.id


async def expire_lease() -> None:
    await asyncio.sleep(LEASE_SECONDS + 0.15)


def test_claims_take_the_highest_priority_first_then_oldest(settings: Settings) -> None:
    async def work(s: Services) -> None:
        low = await submit(s.jobs, 1, priority="low")
        normal_1 = await submit(s.jobs, 2)
        high = await submit(s.jobs, 3, priority="high")
        normal_2 = await submit(s.jobs, 4)
        order = [(await s.queue.claim("w1", block_ms=0)).job_id for _ in range(4)]
        assert order == [high, normal_1, normal_2, low]
        assert await s.queue.claim("w1", block_ms=0) is None
        record = await s.jobs.require("team-a", high)
        assert (record.status, record.attempts, record.worker) == ("running", 1, "w1")

    run_async(settings, work)


def test_a_blocked_claim_wakes_up_for_a_new_job_and_times_out_without_one(settings: Settings) -> None:
    async def work(s: Services) -> None:
        started = time.monotonic()
        assert await s.queue.claim("w1", block_ms=300) is None
        assert 0.25 < time.monotonic() - started < 2

        waiting = asyncio.create_task(s.queue.claim("w1", block_ms=5000))
        await asyncio.sleep(0.2)
        job_id = await submit(s.jobs)
        started = time.monotonic()
        lease = await waiting
        assert lease is not None and lease.job_id == job_id
        assert time.monotonic() - started < 1.5

    run_async(settings, work)


def test_entries_of_cancelled_or_vanished_jobs_are_skipped_and_acknowledged(settings: Settings) -> None:
    async def work(s: Services) -> None:
        cancelled, vanished, live = [await submit(s.jobs, seed) for seed in range(3)]
        await s.jobs.cancel("team-a", cancelled)
        await s.redis.delete(s.jobs.keys.job(vanished))  # its record expired or was removed while queued
        assert (await s.queue.claim("w1", block_ms=0)).job_id == live
        assert await s.queue.claim("w1", block_ms=0) is None
        stream = s.jobs.keys.queue("normal", "team-a")
        assert (await s.redis.xpending(stream, "workers"))["pending"] == 1  # only the live job's lease
        assert await s.redis.xlen(stream) == 1
        assert (await s.jobs.require("team-a", cancelled)).status == "cancelled"

    run_async(settings, work)


def test_heartbeats_keep_a_lease_and_an_expired_one_is_redelivered(settings: Settings) -> None:
    async def work(s: Services) -> None:
        queue = short_lease_queue(s)
        job_id = await submit(s.jobs)
        lease = await queue.claim("w1", block_ms=0)
        for _ in range(5):  # 1.5 leases in all, renewed well within each
            await asyncio.sleep(LEASE_SECONDS * 0.3)
            assert not await queue.heartbeat(lease)
        assert not await queue.reap()  # renewed in time: nothing to do

        await expire_lease()  # w1 goes silent
        assert await queue.reap() == {"requeued": 1}
        record = await s.jobs.require("team-a", job_id)
        assert (record.status, record.worker, record.attempts) == ("queued", None, 1)
        with pytest.raises(LeaseLost):
            await queue.heartbeat(lease)
        with pytest.raises(LeaseLost):
            await s.jobs.update_progress(job_id, "w1", Progress(layer=3, layers=30))

        second = await queue.claim("w2", block_ms=0)
        assert (second.job_id, second.attempt) == (job_id, 2)
        await s.jobs.finish(job_id, "w2", "succeeded")
        await queue.ack(second)
        assert await queue.depth() == {"high": 0, "normal": 0, "low": 0}
        assert await s.redis.xlen(second.stream) == 0

    run_async(settings, work)


def test_a_job_that_keeps_losing_its_worker_fails_with_a_readable_reason(settings: Settings) -> None:
    async def work(s: Services) -> None:
        queue = short_lease_queue(s, max_attempts=2)
        job_id = await submit(s.jobs)
        for worker, expected in (("w1", {"requeued": 1}), ("w2", {"failed": 1})):
            assert (await queue.claim(worker, block_ms=0)).job_id == job_id
            await expire_lease()
            assert await queue.reap() == expected
        record = await s.jobs.require("team-a", job_id)
        assert record.status == "failed" and record.finished_at is not None
        assert "gave up after 2 of 2 attempts" in record.error and "w2" in record.error
        events = await s.jobs.events(job_id)
        assert events[-1].data["status"] == "failed" and "lease" in events[-1].data["error"]
        assert await queue.claim("w3", block_ms=0) is None

    run_async(settings, work)


def test_a_lost_job_that_was_flagged_for_cancel_ends_cancelled(settings: Settings) -> None:
    async def work(s: Services) -> None:
        queue = short_lease_queue(s)
        job_id = await submit(s.jobs)
        await queue.claim("w1", block_ms=0)
        assert (await s.jobs.cancel("team-a", job_id)).outcome == "flagged"
        await expire_lease()
        assert await queue.reap() == {"cancelled": 1}
        assert (await s.jobs.require("team-a", job_id)).status == "cancelled"

    run_async(settings, work)


def test_the_janitor_loop_redelivers_until_stopped(settings: Settings) -> None:
    async def work(s: Services) -> None:
        queue = short_lease_queue(s)
        job_id = await submit(s.jobs)
        await queue.claim("w1", block_ms=0)
        stop = asyncio.Event()
        janitor = asyncio.create_task(run_janitor(queue, 0.2, stop))
        await expire_lease()
        await asyncio.sleep(0.4)
        assert (await s.jobs.require("team-a", job_id)).status == "queued"
        stop.set()
        await asyncio.wait_for(janitor, 2)

    run_async(settings, work)


def test_the_consumer_group_is_recreated_when_redis_lost_it(settings: Settings) -> None:
    async def work(s: Services) -> None:
        await submit(s.jobs, 1)
        stream = s.jobs.keys.queue("normal", "team-a")
        await s.redis.xgroup_destroy(stream, "workers")  # as after a restart that kept the stream only
        assert await s.queue.reap() == {}
        job_id = (await s.queue.claim("w1", block_ms=0)).job_id  # the group is made again, from the start
        assert (await s.jobs.require("team-a", job_id)).status == "running"
        await s.redis.delete(stream)  # and without even the stream
        second = await submit(s.jobs, 2)
        assert (await s.queue.claim("w1", block_ms=0)).job_id == second

    run_async(settings, work)

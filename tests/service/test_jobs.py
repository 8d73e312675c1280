"""The Redis job store against a real redis-server: records, indexes, idempotency, cancel, events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from service.errors import IdempotencyConflict, JobNotFound, LeaseLost
from service.runtime import Services
from service.schemas import JobRequest, Progress
from service.settings import Settings
from tests.support.service import JOB_REQUEST, run_async


@pytest.fixture
def settings(service_settings: Callable[..., Settings]) -> Settings:
    return service_settings()


def request_with(**changes: Any) -> JobRequest:
    body = {**JOB_REQUEST, **changes}
    if "seed" in changes:
        body["calibration"] = {**JOB_REQUEST["calibration"], "seed": body.pop("seed")}
    return JobRequest.model_validate(body)


def test_submit_writes_record_indexes_queue_entry_and_counters(settings: Settings) -> None:
    async def work(s: Services) -> None:
        submission = await s.jobs.submit("team-a", request_with())
        record = submission.record
        assert not submission.replayed
        assert (record.status, record.team, record.attempts, record.request.ratio) == ("queued", "team-a", 0, 0.4)
        assert await s.jobs.get("team-a", record.id) == record
        keys = s.jobs.keys
        assert await s.redis.zrange(keys.team_jobs("team-a"), 0, -1) == [record.id]
        assert await s.redis.zrange(keys.team_status("team-a", "queued"), 0, -1) == [record.id]
        entries = await s.redis.xrange(keys.queue("normal", "team-a"))
        assert [fields["job"] for _, fields in entries] == [record.id]
        assert (await s.jobs.status_counts())["queued"] == 1
        assert await s.queue.depth() == {"high": 0, "normal": 1, "low": 0}

    run_async(settings, work)


def test_ratios_make_linked_jobs_with_one_ratio_each(settings: Settings) -> None:
    async def work(s: Services) -> None:
        body = {k: v for k, v in JOB_REQUEST.items() if k != "ratio"} | {"ratios": [0.3, 0.5, 0.7]}
        first = (await s.jobs.submit("team-a", JobRequest.model_validate(body))).record
        records = [first] + [await s.jobs.require("team-a", other) for other in first.linked]
        assert [r.request.ratio for r in records] == [0.3, 0.5, 0.7]
        assert all(r.request.ratios is None for r in records)
        everyone = {r.id for r in records}
        assert all(set(r.linked) == everyone - {r.id} for r in records)
        assert (await s.queue.depth())["normal"] == 3

    run_async(settings, work)


def test_an_idempotency_key_returns_the_same_job_and_refuses_a_different_body(settings: Settings) -> None:
    async def work(s: Services) -> None:
        first = await s.jobs.submit("team-a", request_with(), idempotency_key="retry-1")
        again = await s.jobs.submit("team-a", request_with(), idempotency_key="retry-1")
        assert again.replayed and again.record.id == first.record.id
        with pytest.raises(IdempotencyConflict, match=first.record.id):
            await s.jobs.submit("team-a", request_with(ratio=0.9), idempotency_key="retry-1")
        other_team = await s.jobs.submit("team-b", request_with(), idempotency_key="retry-1")
        assert not other_team.replayed and other_team.record.id != first.record.id
        assert (await s.jobs.status_counts())["queued"] == 2

    run_async(settings, work)


def test_an_identical_body_returns_the_live_job_but_resubmits_a_failed_one(settings: Settings) -> None:
    async def work(s: Services) -> None:
        first = (await s.jobs.submit("team-a", request_with())).record
        assert (await s.jobs.submit("team-a", request_with(priority="high"))).record.id == first.id
        assert not (await s.jobs.submit("team-a", request_with(seed=1))).replayed
        lease = await s.queue.claim("w1", block_ms=0)
        assert lease is not None and lease.job_id == first.id
        await s.jobs.finish(first.id, "w1", "failed", "out of memory on layer 3")
        retry = await s.jobs.submit("team-a", request_with())
        assert not retry.replayed and retry.record.id != first.id

    run_async(settings, work)


def test_list_pages_newest_first_with_a_cursor_and_filters_by_status(settings: Settings) -> None:
    async def work(s: Services) -> None:
        ids = [(await s.jobs.submit("team-a", request_with(seed=seed))).record.id for seed in range(7)]
        await s.jobs.submit("team-b", request_with())
        seen, cursor, pages = [], None, 0
        while True:
            page, cursor = await s.jobs.list("team-a", limit=3, cursor=cursor)
            seen += [r.id for r in page]
            pages += 1
            if cursor is None:
                break
        assert pages == 3 and seen == sorted(ids, reverse=True)
        for job_id in ids[:2]:
            await s.jobs.cancel("team-a", job_id)
        cancelled, _ = await s.jobs.list("team-a", status="cancelled")
        queued, _ = await s.jobs.list("team-a", status="queued")
        assert {r.id for r in cancelled} == set(ids[:2])
        assert len(queued) == 5 and all(r.status == "queued" for r in queued)

    run_async(settings, work)


def test_other_teams_jobs_do_not_exist_for_you(settings: Settings) -> None:
    async def work(s: Services) -> None:
        job = (await s.jobs.submit("team-a", request_with())).record
        assert await s.jobs.get("team-b", job.id) is None
        with pytest.raises(JobNotFound):
            await s.jobs.cancel("team-b", job.id)
        assert (await s.jobs.list("team-b"))[0] == []
        assert (await s.jobs.require("team-a", job.id)).status == "queued"

    run_async(settings, work)


def test_cancel_queued_never_runs_running_is_flagged_finished_is_left_alone(settings: Settings) -> None:
    async def work(s: Services) -> None:
        queued = (await s.jobs.submit("team-a", request_with(seed=1))).record
        cancellation = await s.jobs.cancel("team-a", queued.id)
        assert (cancellation.outcome, cancellation.record.status) == ("cancelled", "cancelled")
        assert await s.queue.claim("w1", block_ms=0) is None  # its queue entry is gone

        running = (await s.jobs.submit("team-a", request_with(seed=2))).record
        lease = await s.queue.claim("w1", block_ms=0)
        assert lease is not None and lease.job_id == running.id
        assert not await s.jobs.update_progress(running.id, "w1", Progress(layer=1, layers=30, stage="compressing"))
        flagged = await s.jobs.cancel("team-a", running.id)
        assert (flagged.outcome, flagged.record.status, flagged.record.cancel_requested) == ("flagged", "running", True)
        assert await s.jobs.update_progress(running.id, "w1", Progress(layer=2, layers=30, stage="compressing"))
        assert await s.queue.heartbeat(lease)
        await s.jobs.finish(running.id, "w1", "cancelled")
        assert (await s.jobs.cancel("team-a", running.id)).outcome == "cancelled"

        done = (await s.jobs.submit("team-a", request_with(seed=3))).record
        await s.queue.claim("w1", block_ms=0)
        await s.jobs.finish(done.id, "w1", "succeeded")
        assert (await s.jobs.cancel("team-a", done.id)).outcome == "succeeded"
        counts = await s.jobs.status_counts()
        assert counts == {"queued": 0, "running": 0, "succeeded": 1, "failed": 0, "cancelled": 2}

    run_async(settings, work)


def test_only_the_lease_holder_may_report_progress_or_finish(settings: Settings) -> None:
    async def work(s: Services) -> None:
        job = (await s.jobs.submit("team-a", request_with())).record
        with pytest.raises(LeaseLost):  # still queued
            await s.jobs.update_progress(job.id, "w1", Progress())
        await s.queue.claim("w1", block_ms=0)
        with pytest.raises(LeaseLost):
            await s.jobs.finish(job.id, "w2", "succeeded")
        with pytest.raises(ValueError, match="reason"):
            await s.jobs.finish(job.id, "w1", "failed")
        with pytest.raises(ValueError, match="succeeded, failed or cancelled"):
            await s.jobs.finish(job.id, "w1", "queued")

    run_async(settings, work)


def test_events_tell_the_whole_story_in_order(settings: Settings) -> None:
    async def work(s: Services) -> None:
        job = (await s.jobs.submit("team-a", request_with())).record
        lease = await s.queue.claim("w1", block_ms=0)
        assert lease is not None
        for layer in (1, 2):
            progress = Progress(layer=layer, layers=2, stage="compressing", eta_seconds=10.0 / layer)
            await s.jobs.update_progress(job.id, "w1", progress)
        await s.jobs.finish(job.id, "w1", "succeeded")
        events = await s.jobs.events(job.id)
        story = [(e.type, e.data.get("status") or e.data.get("layer")) for e in events]
        assert story == [
            ("status", "queued"),
            ("status", "running"),
            ("progress", 1),
            ("progress", 2),
            ("status", "succeeded"),
        ]
        assert events[1].data["attempts"] == 1 and events[1].data["worker"] == "w1"
        assert await s.jobs.events(job.id, after=events[-1].id, block_ms=50) == []
        record = await s.jobs.require("team-a", job.id)
        assert (record.progress.layer, record.finished_at is not None) == (2, True)

    run_async(settings, work)

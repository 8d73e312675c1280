"""The one retry policy: which failures end a job, which are re-delivered, and how long to wait."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from ftc.options import InputError
from service.errors import StoreUnavailable
from service.keys import CONSUMER_GROUP
from service.retry import NEVER_RETRIED, RetryPolicy, error_kind
from service.runtime import Services
from service.schemas import TERMINAL_STATUSES, JobRecord, JobRequest
from service.settings import Settings
from tests.support.service import run_async
from tests.support.workers import worker_job_request
from workers import attempt
from workers.actor import JobWorker

TEAM = "team-a"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_error_kinds_and_which_are_retried() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert error_kind(InputError("bad")) == "invalid_input"
    assert error_kind(MemoryError()) == "out_of_memory"
    assert error_kind(StoreUnavailable("down")) == "store_unavailable"
    assert error_kind(RuntimeError("bug")) == "error"
    assert "invalid_input" in NEVER_RETRIED
    assert not policy.redelivers("invalid_input", 1)
    assert policy.redelivers("store_unavailable", 1) and policy.redelivers("store_unavailable", 2)
    assert not policy.redelivers("store_unavailable", 3)


def test_backoff_doubles_up_to_its_cap_and_comes_from_settings() -> None:
    policy = RetryPolicy.from_settings(Settings(redis_retry_seconds=0.5, redis_retry_max_seconds=3.0,
                                                store_backoff_seconds=1.0, store_backoff_max_seconds=2.5,
                                                lease_seconds=40, max_attempts=4, store_retries=7))
    assert [policy.redis_delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    assert [policy.store_delay(n) for n in (1, 2, 3)] == [1.0, 2.0, 2.5]
    assert (policy.lease_seconds, policy.heartbeat_seconds, policy.max_attempts, policy.store_attempts) == (
        40, 10.0, 4, 7)


async def _run_until_ended(services: Services, settings, job_id: str, reap_every: float | None = None) -> JobRecord:
    worker = JobWorker(settings, "cpu0", "cpu")
    task = asyncio.create_task(worker.run())
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 240  # generous: a loaded CI machine imports torch slowly
        while (record := await services.jobs.require(TEAM, job_id)).status not in TERMINAL_STATUSES:
            assert loop.time() < deadline, f"job still {record.status}"
            if reap_every is not None:
                await services.queue.reap()
            await asyncio.sleep(reap_every or 0.05)
        return record
    finally:
        await worker.stop()
        await task


async def _pending(services: Services) -> int:
    counts = [await services.redis.xpending(stream, CONSUMER_GROUP) for stream in await services.queue.streams()]
    return sum(int(c["pending"]) for c in counts)


def test_an_input_error_fails_the_job_on_its_first_attempt_without_redelivery(worker_settings, models_dir) -> None:
    settings = worker_settings(max_attempts=3)
    _root, model = models_dir(layers=2)
    request = worker_job_request(model, calibration={"samples": 1, "seq_len": 16})  # too few tokens: InputError

    async def scenario(services: Services):
        job_id = (await services.jobs.submit(TEAM, JobRequest.model_validate(request))).record.id
        record = await _run_until_ended(services, settings, job_id)
        return record, await _pending(services), await services.queue.reap()

    record, pending, reaped = run_async(settings, scenario)
    assert record.status == "failed" and record.error_kind == "invalid_input"
    assert record.attempts == 1 and "raise --calib-samples or --seq-len" in record.error
    assert pending == 0 and not reaped, "the entry is acknowledged: nothing is left to re-deliver"


def test_a_transient_failure_is_redelivered_until_max_attempts(worker_settings, models_dir, monkeypatch) -> None:
    settings = worker_settings(max_attempts=2, lease_seconds=5)
    _root, model = models_dir(layers=2)
    runs: list[int] = []

    def unavailable(self) -> None:
        runs.append(self.lease.attempt)
        raise StoreUnavailable("object store unavailable: put failed 5 times")

    monkeypatch.setattr(attempt.Attempt, "run", unavailable)

    async def scenario(services: Services):
        job_id = (await services.jobs.submit(TEAM, JobRequest.model_validate(worker_job_request(model)))).record.id
        return await _run_until_ended(services, settings, job_id, reap_every=0.5)

    record = run_async(settings, scenario)
    assert runs == [1, 2]
    assert record.status == "failed" and record.error_kind == "store_unavailable" and record.attempts == 2
    assert "StoreUnavailable" in record.error

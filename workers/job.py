"""A claimed job from start to end: keep its lease, run the attempt, record how it ended.

The outcome decides what happens to the queue entry. A job that ended (succeeded, failed,
cancelled) is recorded and then acknowledged, in that order, so a crash in between re-delivers a
job whose record already says how it ended (the queue then drops it). A job whose lease was lost
belongs to someone else and is left alone. A job interrupted by a worker shutdown is left
unacknowledged: its lease runs out, the janitor re-delivers it and another worker resumes it. A
failed attempt is final or left for re-delivery the same way, as the `RetryPolicy` decides from
its error kind (service/retry.py): a bad request (`InputError`) fails on its first attempt.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

from ftc.options import InputError
from service.errors import LeaseLost
from service.logs import set_log_context
from service.queue import Lease
from service.redis_client import REDIS_DOWN_ERRORS
from service.retention import after_success, purge_due
from service.retry import error_kind
from service.runtime import Services
from service.store.layout import LOG, job_prefix
from workers.attempt import Attempt
from workers.control import JobCancelled, JobControl, WorkerStopping
from workers.joblog import JobLog
from workers.metrics import record_attempt, record_outcome
from workers.settings import WorkerSettings

log = logging.getLogger(__name__)

MAX_REASON_CHARS = 500
ENDED = ("succeeded", "failed", "cancelled")


def summarise(error: BaseException) -> str:
    """One line a submitter can act on; the traceback stays in the job log."""
    if isinstance(error, InputError):
        text = str(error)
    else:
        first = (str(error).strip().splitlines() or [""])[0]
        text = f"{type(error).__name__}: {first}" if first else type(error).__name__
        text += f" (details in {LOG})"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


async def run_job(
    services: Services, settings: WorkerSettings, lease: Lease, device: str, shutdown: threading.Event
) -> str:
    """Run the job `lease` holds; returns succeeded, failed, cancelled, lost or interrupted."""
    policy = services.queue.policy
    record = await services.jobs.claimed(lease.job_id)
    set_log_context(job_id=lease.job_id, team=record.team)
    started = time.monotonic()
    record_attempt(lease.attempt)
    control = JobControl(asyncio.get_running_loop(), services.jobs, lease, shutdown)
    folder = Path(settings.work_dir) / "jobs" / f"{lease.job_id}-{lease.attempt}-{uuid.uuid4().hex[:8]}"
    job_log = JobLog(services.store, job_prefix(record.team, record.id), folder / LOG)
    keeper = asyncio.create_task(control.keep_lease(services.queue, policy.heartbeat_seconds))
    error: str | None = None
    kind: str | None = None
    failure: Exception | None = None
    try:
        await asyncio.to_thread(job_log.open)
        log.info(
            "job %s: attempt %d of %d on worker %s (device %s)",
            lease.job_id,
            lease.attempt,
            policy.max_attempts,
            lease.worker,
            device,
        )
        attempt = Attempt(record, lease, settings, services.store, device, control, job_log, folder)
        try:
            await asyncio.to_thread(attempt.run)
            outcome = "succeeded"
        except JobCancelled:
            outcome = "cancelled"
        except LeaseLost:
            outcome = "lost"
        except WorkerStopping:
            outcome = "interrupted"
        except Exception as raised:
            log.exception("job %s failed", lease.job_id)
            kind = error_kind(raised)
            if policy.redelivers(kind, lease.attempt):
                outcome = "retry"
            else:
                outcome, error, failure = "failed", summarise(raised), raised
        if control.lost:  # whatever happened after the lease was lost is not ours to record
            outcome = "lost"
        log.info("job %s: %s%s", lease.job_id, _describe(outcome), f": {error}" if error else "")
        if outcome != "lost":
            await asyncio.to_thread(job_log.upload)
    finally:
        keeper.cancel()
        job_log.close()
        shutil.rmtree(folder, ignore_errors=True)
    record_outcome(outcome, time.monotonic() - started, failure)
    recorded = outcome in ENDED and await _record(services, lease, outcome, error, kind)
    if recorded and outcome == "succeeded":  # a job left for re-delivery still resumes from them
        await _retire_checkpoints(services, settings, job_prefix(record.team, record.id))
    return outcome


async def _retire_checkpoints(services: Services, settings: WorkerSettings, prefix: str) -> None:
    """Mark (or delete) the succeeded job's checkpoints, and delete other jobs' that are due.

    Best effort: the job has succeeded whatever happens here. A due folder left over is deleted by a
    later pass; a job whose mark could not be written keeps its checkpoints (docs/workers.md)."""
    key_prefix, now = services.settings.key_prefix, time.time()
    try:
        await after_success(services.redis, services.store, key_prefix, prefix, settings.keep_checkpoints_seconds, now)
        await purge_due(services.redis, services.store, key_prefix, now)
    except Exception as error:
        log.warning("checkpoints of %s or of earlier jobs not retired (%s)", prefix, error)


def _describe(outcome: str) -> str:
    return {
        "lost": "lease lost; another worker has the job",
        "interrupted": "interrupted by worker shutdown; left for re-delivery (it resumes from its checkpoints)",
        "retry": "attempt failed; left for re-delivery when its lease runs out (it resumes from its checkpoints)",
    }.get(outcome, outcome)


async def _record(services: Services, lease: Lease, status: str, error: str | None, kind: str | None) -> bool:
    """Finish the record, then acknowledge; Redis restarts are waited out for up to a lease.

    Returns whether the record now says how the job ended (else it will be re-delivered)."""
    policy = services.queue.policy
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.lease_seconds
    failures = 0
    while True:
        try:
            await services.jobs.finish(lease.job_id, lease.worker, status, error, kind)
            await services.queue.ack(lease)
            return True
        except LeaseLost as lost:
            log.warning("could not record %s: %s", status, lost)
            return False
        except REDIS_DOWN_ERRORS as down:
            failures += 1
            delay = policy.redis_delay(failures)
            if loop.time() + delay > deadline:
                log.error("could not record %s for job %s (%s); it will be re-delivered", status, lease.job_id, down)
                return False
            await asyncio.sleep(delay)

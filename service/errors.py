"""Errors the job store and queue raise where the problem is known, each saying what to do."""

from __future__ import annotations


class JobNotFound(Exception):
    """No such job for this team (another team's job is reported the same way, so ids do not leak)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} not found")
        self.job_id = job_id


class IdempotencyConflict(Exception):
    """An Idempotency-Key was reused with a different request body."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"Idempotency-Key was already used for job {job_id} with a different request; "
            "use a new key for a new request"
        )
        self.job_id = job_id


class LeaseLost(Exception):
    """The job is no longer this worker's: its lease expired and it was re-delivered, or it ended."""

    def __init__(self, job_id: str, worker: str) -> None:
        super().__init__(f"worker {worker} no longer holds job {job_id}; stop working on it")
        self.job_id = job_id
        self.worker = worker


class StoreUnavailable(Exception):
    """The object store could not be reached, even after retrying with backoff."""


class QuotaExceeded(Exception):
    """A team reached one of its limits (service/teams.py); the API answers 429 with Retry-After.

    `limit` is the limit's name (`queued_jobs`, `submissions_per_minute`, ...), `retry_after` the
    seconds after which trying again may succeed.
    """

    def __init__(self, limit: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after = max(1, int(retry_after))

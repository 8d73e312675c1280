"""The one retry policy of the service: attempts, leases, backoff, and which failures are final.

Every number comes from `Settings` (`FTC_*` variables), so one environment describes how a
deployment retries; docs/workers.md has the table. The queue (leases, the janitor's give-up), the
object store (retries of one call), the workers (Redis outages while claiming or recording, and
what a failed attempt leads to) all read this object instead of keeping their own constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftc.options import InputError
from service.errors import StoreUnavailable
from service.settings import Settings

ERROR_KINDS: dict[str, str] = {
    "invalid_input": "the request cannot run as given (a missing model, too little calibration, ...)",
    "out_of_memory": "the job does not fit the worker's memory",
    "store_unavailable": "the object store stayed unreachable through all of its call retries",
    "worker_lost": "the worker stopped renewing its lease (crashed, killed or hung) on the last attempt",
    "error": "anything else; the traceback is in the job log",
}
"""Why a job failed, as recorded in its `error_kind` and counted by the worker metrics."""

NEVER_RETRIED: frozenset[str] = frozenset({"invalid_input", "out_of_memory", "error"})
"""Failures that end the job on the attempt that met them: running the same request again on
another worker gives the same answer. The others are left for re-delivery until `max_attempts`."""


def error_kind(error: BaseException) -> str:
    """The `ERROR_KINDS` name of an exception raised inside a job attempt."""
    if isinstance(error, InputError):
        return "invalid_input"
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":  # torch.cuda's, unimported
        return "out_of_memory"
    if isinstance(error, StoreUnavailable):
        return "store_unavailable"
    return "error"


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently every part of the service retries (see the module docstring)."""

    max_attempts: int = 3
    """Deliveries of one job, counting the first, before it fails for good."""
    lease_seconds: int = 120
    """A job whose worker stops heartbeating for this long is re-delivered by the janitor."""
    redis_retry_seconds: float = 0.2
    """First wait after Redis did not answer; doubles on each further failure."""
    redis_retry_max_seconds: float = 5.0
    """Longest wait between two tries to reach Redis."""
    store_attempts: int = 5
    """Tries of one object-store call before it raises `StoreUnavailable`."""
    store_backoff_seconds: float = 0.2
    """First wait between two object-store tries; doubles on each further failure."""
    store_backoff_max_seconds: float = 10.0
    """Longest wait between two object-store tries."""
    never_retried: frozenset[str] = NEVER_RETRIED

    @classmethod
    def from_settings(cls, settings: Settings) -> RetryPolicy:
        return cls(
            max_attempts=settings.max_attempts,
            lease_seconds=settings.lease_seconds,
            redis_retry_seconds=settings.redis_retry_seconds,
            redis_retry_max_seconds=settings.redis_retry_max_seconds,
            store_attempts=settings.store_retries,
            store_backoff_seconds=settings.store_backoff_seconds,
            store_backoff_max_seconds=settings.store_backoff_max_seconds,
        )

    @property
    def heartbeat_seconds(self) -> float:
        """A quarter of the lease: three heartbeats may be missed before the job is taken away."""
        return self.lease_seconds / 4

    def redis_delay(self, failures: int) -> float:
        """The wait after the `failures`-th consecutive failure to reach Redis (1, 2, ...)."""
        return min(self.redis_retry_max_seconds, self.redis_retry_seconds * 2 ** max(failures - 1, 0))

    def store_delay(self, failures: int) -> float:
        """The wait after the `failures`-th consecutive transient object-store failure (before jitter)."""
        return min(self.store_backoff_max_seconds, self.store_backoff_seconds * 2 ** max(failures - 1, 0))

    def redelivers(self, kind: str, attempt: int) -> bool:
        """Whether a job whose attempt number `attempt` failed with `kind` gets another attempt."""
        return kind not in self.never_retried and attempt < self.max_attempts

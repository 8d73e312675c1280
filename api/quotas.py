"""The per-team checks a route makes before it writes: who may use priority high, and whether one
submission could ever fit the team's queued-jobs limit. The limits that depend on what is already
there (queued jobs, submission rate, sweeps, upload bytes) are checked atomically where the write
happens, in service/."""

from __future__ import annotations

from fastapi import HTTPException, status
from fastapi.exceptions import RequestValidationError

from service.teams import TeamPolicy, limit_source, priority_problem


def refuse_beyond(policy: TeamPolicy, priority: str, jobs: int, jobs_loc: tuple[str, ...]) -> None:
    """403 for a priority the team may not use; 422 (at `jobs_loc`) when `jobs` jobs made by one
    submission are more than the team may ever have queued, so no wait would let them in."""
    if problem := priority_problem(policy, priority):
        raise HTTPException(status.HTTP_403_FORBIDDEN, problem)
    if policy.queued_jobs and jobs > policy.queued_jobs:
        message = (
            f"this makes {jobs} jobs at once, more than your team may have queued ({policy.queued_jobs}; "
            f"queued_jobs: {limit_source('queued_jobs')}); send fewer"
        )
        raise RequestValidationError([{"loc": jobs_loc, "msg": message, "type": "value_error"}])

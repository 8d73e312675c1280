"""Submit, read, list and cancel jobs. Every route is scoped to the caller's team."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Path, Query, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from api.deps import AppSettings, Jobs, Store, Team
from api.errors import documented
from api.quotas import refuse_beyond
from service.ids import ID_PATTERN
from service.schemas import JobPage, JobRecord, JobRequest, JobStatus, calibration_limit_problems, is_upload_uri
from service.teams import policies_for
from service.uploads import upload_problems

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=documented(401, 503))

JobId = Annotated[str, Path(pattern=ID_PATTERN, description="A job id, e.g. job_01jd...")]


class JobFilter(BaseModel):
    """Query of GET /v1/jobs; unknown parameters are refused so a typo does not silently list everything."""

    model_config = ConfigDict(extra="forbid")

    status: JobStatus | None = None
    limit: int = Field(50, ge=1, le=500)
    cursor: str | None = Field(None, pattern=ID_PATTERN, description="next_cursor of the previous page")


def _json(record: JobRecord, code: int, headers: dict[str, str] | None = None) -> Response:
    # Serialised once here; returning a Response skips a second validation pass on the hot path.
    return Response(record.model_dump_json(by_alias=True), code, headers, media_type="application/json")


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobRecord,
    responses={
        200: {"model": JobRecord, "description": "An earlier submission with this Idempotency-Key (or body)"},
        **documented(400, 403, 409, 429),
    },
)
async def submit_job(
    body: JobRequest,
    team: Team,
    jobs: Jobs,
    store: Store,
    settings: AppSettings,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
) -> Response:
    """Queue a job (with `ratios`, one linked job per ratio; the first is returned). Beyond one of the
    team's quotas (queued jobs, submissions a minute) the answer is 429 naming the limit."""
    policy = policies_for(settings).of(team)
    refuse_beyond(policy, body.priority, len(body.keep_ratios()), ("body", "ratios"))
    if problems := calibration_limit_problems(body.calibration, settings.max_calib_tokens, ("body", "calibration")):
        raise RequestValidationError(problems)
    if any(is_upload_uri(name) for name in body.datasets()):  # only then is the store consulted
        problems = await asyncio.to_thread(upload_problems, store, team, body)
        if problems:
            raise RequestValidationError(problems)
    submission = await jobs.submit(team, body, idempotency_key, policy=policy)
    record = submission.record
    headers = {"Location": f"/v1/jobs/{record.id}"}
    if submission.replayed:
        return _json(record, status.HTTP_200_OK, headers | {"Idempotent-Replayed": "true"})
    return _json(record, status.HTTP_201_CREATED, headers)


@router.get("", response_model=JobPage)
async def list_jobs(team: Team, jobs: Jobs, query: Annotated[JobFilter, Query()]) -> JobPage:
    """The team's jobs, newest first."""
    records, next_cursor = await jobs.list(team, status=query.status, limit=query.limit, cursor=query.cursor)
    return JobPage(jobs=records, next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobRecord, responses=documented(404))
async def get_job(job_id: JobId, team: Team, jobs: Jobs) -> Response:
    return _json(await jobs.require(team, job_id), status.HTTP_200_OK)


@router.delete(
    "/{job_id}",
    response_model=JobRecord,
    responses=documented(404, 409),
)
async def cancel_job(job_id: JobId, team: Team, jobs: Jobs) -> Response:
    """Cancel: a queued job never runs; a running one is flagged and its worker stops between layers."""
    cancellation = await jobs.cancel(team, job_id)
    if cancellation.outcome in ("succeeded", "failed"):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"job {job_id} already {cancellation.outcome}; there is nothing to cancel",
        )
    return _json(cancellation.record, status.HTTP_200_OK)


@router.post(
    "/{job_id}/retry",
    status_code=status.HTTP_201_CREATED,
    response_model=JobRecord,
    responses={
        200: {"model": JobRecord, "description": "The job was retried before: its live retry"},
        **documented(404, 409),
    },
)
async def retry_job(job_id: JobId, team: Team, jobs: Jobs, store: Store, settings: AppSettings) -> Response:
    """Submit a failed or cancelled job's request again, as a new job (the answer, with its
    `Location`). Retrying the same job twice returns the live retry, as an identical submission does."""
    record = await jobs.require(team, job_id)
    if record.status not in ("failed", "cancelled"):
        reason = "it has not ended yet; cancel it first" if record.status in ("queued", "running") else (
            "its results are there; download them")
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is {record.status}: nothing to retry ({reason})")
    return await submit_job(record.request, team, jobs, store, settings, None)

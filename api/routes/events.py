"""A job's status and per-layer progress as server-sent events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import StreamingResponse

from api.deps import Jobs, Team
from api.errors import documented
from api.routes.jobs import JobId
from api.sse import job_event_stream

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=documented(401, 503))

_EVENT_ID_PATTERN = r"^\d{1,20}-\d{1,20}$"


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "status, progress and cancel events"},
        **documented(404),
    },
)
async def job_events(
    job_id: JobId,
    team: Team,
    jobs: Jobs,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", pattern=_EVENT_ID_PATTERN)] = None,
) -> StreamingResponse:
    """Replays the job's events (after Last-Event-ID, if sent), then streams new ones; the stream
    ends after the job's final status."""
    await jobs.require(team, job_id)
    return StreamingResponse(
        job_event_stream(jobs, team, job_id, after=last_event_id or "0-0"),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

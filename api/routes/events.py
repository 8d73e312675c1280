"""A job's status and per-layer progress as server-sent events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Request, status
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator

from api.deps import AppSettings, Jobs, Team
from api.errors import RETRY_AFTER_SECONDS, documented
from api.routes.jobs import JobId
from api.sse import EventHub, SlotStreamingResponse, StreamSlots, job_event_stream

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=documented(401, 503))

_EVENT_ID_PATTERN = r"^\d{1,20}-\d{1,20}$"
_LARGEST_PART = 2**64 - 1
"""Both halves of a Redis stream id are unsigned 64-bit numbers; 20 digits can say more than that."""


def check_event_id(value: str | None) -> str | None:
    if value is not None and any(int(part) > _LARGEST_PART for part in value.split("-")):
        raise ValueError(f"both parts of an event id are at most {_LARGEST_PART}; send an id the stream gave you")
    return value


EventId = Annotated[
    str | None, Header(alias="Last-Event-ID", pattern=_EVENT_ID_PATTERN), AfterValidator(check_event_id)
]


async def get_hub(request: Request) -> EventHub:
    return request.app.state.event_hub


async def get_slots(request: Request) -> StreamSlots:
    return request.app.state.stream_slots


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "status, progress and cancel events"},
        **documented(404),
        429: {"description": "The team holds FTC_MAX_STREAMS_PER_TEAM streams already (over all API processes)"},
    },
)
async def job_events(
    job_id: JobId,
    team: Team,
    jobs: Jobs,
    hub: Annotated[EventHub, Depends(get_hub)],
    slots: Annotated[StreamSlots, Depends(get_slots)],
    settings: AppSettings,
    last_event_id: EventId = None,
) -> StreamingResponse:
    """Replays the job's events (after Last-Event-ID, if sent), then streams new ones; the stream
    ends after the job's final status. One team holds at most FTC_MAX_STREAMS_PER_TEAM streams
    over all API processes, so it cannot use up the API that other teams share."""
    record = await jobs.require(team, job_id)
    slot = await slots.take(team, settings.max_streams_per_team)
    if slot is None:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            f"your team follows {settings.max_streams_per_team} event streams already "
            "(FTC_MAX_STREAMS_PER_TEAM); close some, or retry later",
            headers={"Retry-After": RETRY_AFTER_SECONDS},
        )
    return SlotStreamingResponse(
        job_event_stream(hub, jobs, record, after=last_event_id or "0-0"),
        on_close=lambda: slots.give_back(slot),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

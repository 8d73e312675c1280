"""Server-sent events for one job: replay its event stream, then follow it until the job ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from service.jobs import JobStore
from service.redis_client import REDIS_DOWN_ERRORS
from service.schemas import TERMINAL_STATUSES, JobEvent

POLL_MS = 1000  # below the Redis socket timeout, so a blocking read never looks like an outage
KEEPALIVE_SECONDS = 15.0
RECONNECT_MS = 2000


def format_event(event: JobEvent) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(event.data, separators=(',', ':'))}\n\n"


def is_final(event: JobEvent) -> bool:
    return event.type == "status" and event.data.get("status") in TERMINAL_STATUSES


async def job_event_stream(
    jobs: JobStore, team: str, job_id: str, after: str = "0-0", poll_ms: int = POLL_MS
) -> AsyncIterator[str]:
    """SSE text: every event after `after` (a Last-Event-ID), live ones as they come, ending after the
    terminal status. A Redis outage ends the stream; clients reconnect with Last-Event-ID."""
    yield f"retry: {RECONNECT_MS}\n\n"
    quiet_seconds = 0.0
    try:
        while True:
            events = await jobs.events(job_id, after, block_ms=poll_ms)
            for event in events:
                yield format_event(event)
                after = event.id
                if is_final(event):
                    return
            if events:
                quiet_seconds = 0.0
                continue
            quiet_seconds += poll_ms / 1000
            if quiet_seconds >= KEEPALIVE_SECONDS:
                quiet_seconds = 0.0
                yield ": keep-alive\n\n"
            record = await jobs.get(team, job_id)
            if record is None or record.status in TERMINAL_STATUSES:
                # Its final event is gone (trimmed or the job removed): end with the record's word.
                if record is not None:
                    data = {
                        "status": record.status,
                        "at": record.updated_at.timestamp(),
                        "error": record.error,
                    }
                    yield format_event(JobEvent(id=after, type="status", data=data))
                return
    except REDIS_DOWN_ERRORS:
        yield ": job store unreachable; reconnect with Last-Event-ID\n\n"

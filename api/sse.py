"""Server-sent events for jobs: one Redis reader per API process, fanned out to every open stream.

A stream used to wait on its own blocking `XREAD`, which holds a pooled Redis connection for as long
as the client listens; about a hundred open streams emptied the pool (100 connections) and every
other route, `/readyz` included, answered 503. Now each stream replays its history with one short
read and then waits on an in-process queue; `EventHub` keeps a single connection of its own that
blocks on the event streams of every followed job at once and hands each new event to the streams
that follow that job. Streams cost memory, not connections, so one process holds thousands.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.asyncio import Redis

from service.jobs import JobStore, events_from_reply
from service.redis_client import REDIS_DOWN_ERRORS, connect
from service.schemas import TERMINAL_STATUSES, JobEvent, JobRecord
from service.settings import Settings

log = logging.getLogger(__name__)

POLL_MS = 1000  # below the Redis socket timeout, so a blocking read never looks like an outage
KEEPALIVE_SECONDS = 15.0
RECONNECT_MS = 2000
READ_COUNT = 100
"""Events per job per read: a long history arrives over several reads, in order."""
OUTAGE_BACKOFF_SECONDS = 0.5


def format_event(event: JobEvent) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(event.data, separators=(',', ':'))}\n\n"


def is_final(event: JobEvent) -> bool:
    return event.type == "status" and event.data.get("status") in TERMINAL_STATUSES


def stream_position(event_id: str) -> tuple[int, int]:
    """A Redis stream id (`ms-seq`) as a pair that sorts the way Redis orders entries."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


class StreamEnded(Exception):
    """The hub stopped reading for this stream (Redis went away, or the API is shutting down)."""


@dataclass(eq=False)
class Subscription:
    """One open event stream: where it has read up to, and the events handed to it since."""

    job_id: str
    team: str
    after: str
    queue: asyncio.Queue[list[JobEvent] | BaseException] = field(default_factory=asyncio.Queue)

    async def next(self, timeout: float) -> list[JobEvent]:
        """The next events (oldest first), or [] after `timeout` seconds without any."""
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return []
        if isinstance(item, BaseException):
            raise item
        return item


class EventHub:
    """Reads the event streams of every followed job on one connection and fans them out.

    The reader blocks on all followed streams with one `XREAD` (up to `block_ms`). A stream that
    starts being followed while that read waits is picked up at once: the hub interrupts the wait
    with `CLIENT UNBLOCK` (sent on the shared pool) and reads again with the new stream included.
    """

    def __init__(self, redis: Redis, jobs: JobStore, settings: Settings, block_ms: int = POLL_MS) -> None:
        self.redis = redis
        self.jobs = jobs
        self.block_ms = block_ms
        self._reader = connect(settings, max_connections=1)
        self._reader_id: int | None = None
        self._followers: dict[str, set[Subscription]] = {}
        self._per_team: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._reading: frozenset[str] = frozenset()
        """Jobs of the blocking read in progress (empty when none waits)."""
        self._interrupted = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-hub")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._end_all(StreamEnded("the API is shutting down"))
        await self._reader.aclose()

    def streams_of(self, team: str) -> int:
        """Streams `team` follows on this process (the route refuses more than FTC_MAX_STREAMS_PER_TEAM)."""
        return self._per_team.get(team, 0)

    @contextlib.asynccontextmanager
    async def follow(self, team: str, job_id: str, after: str) -> AsyncIterator[Subscription]:
        """Follow one job's events after `after`; the caller replays the history itself first."""
        subscription = Subscription(job_id, team, after)
        self._followers.setdefault(job_id, set()).add(subscription)
        self._per_team[team] = self._per_team.get(team, 0) + 1
        self._changed.set()
        try:  # from here on, a client that goes away (cancellation) must not leave its subscription behind
            await self._interrupt_wait(job_id)
            yield subscription
        finally:
            self._per_team[team] -= 1
            if not self._per_team[team]:
                del self._per_team[team]
            followers = self._followers.get(job_id)
            if followers is not None:
                followers.discard(subscription)
                if not followers:
                    del self._followers[job_id]

    async def _interrupt_wait(self, job_id: str) -> None:
        """End the reader's blocking read early when it does not cover `job_id`, so a new stream
        need not wait for it. Once per read: a burst of new streams costs one more read, not one each."""
        if not self._reading or job_id in self._reading or self._interrupted or self._reader_id is None:
            return
        self._interrupted = True
        with contextlib.suppress(*REDIS_DOWN_ERRORS):  # best effort: the read ends by itself soon
            await self.redis.client_unblock(self._reader_id)

    def _end_all(self, error: BaseException) -> None:
        for followers in self._followers.values():
            for subscription in followers:
                subscription.queue.put_nowait(error)
        self._followers.clear()

    async def _run(self) -> None:
        while True:
            if not self._followers:
                await self._changed.wait()
            self._changed.clear()
            try:
                if self._reader_id is None:
                    self._reader_id = await self._reader.client_id()
                await self._read_once()
            except REDIS_DOWN_ERRORS as error:
                log.warning("event streams: Redis unreachable (%s); open streams end, clients reconnect", error)
                self._reader_id = None  # a new connection has a new id
                self._end_all(StreamEnded(str(error)))
                await asyncio.sleep(OUTAGE_BACKOFF_SECONDS)
            except Exception:  # a bug must not stop every stream of the process for good
                log.exception("event streams: unexpected error; open streams end")
                self._reader_id = None
                self._end_all(StreamEnded("internal error"))
                await asyncio.sleep(OUTAGE_BACKOFF_SECONDS)

    async def _read_once(self) -> None:
        cursors = {
            self.jobs.keys.events(job_id): min((s.after for s in followers), key=stream_position)
            for job_id, followers in self._followers.items()
        }
        if not cursors:
            return
        self._reading, self._interrupted = frozenset(self._followers), False
        try:
            reply = await self._reader.xread(cursors, count=READ_COUNT, block=self.block_ms)
        finally:
            self._reading = frozenset()
        for key, entries in reply or []:
            job_id = self.jobs.keys.job_id_of_events(key)
            events = events_from_reply([(key, entries)])
            for subscription in self._followers.get(job_id, ()):
                position = stream_position(subscription.after)
                fresh = [event for event in events if stream_position(event.id) > position]
                if fresh:
                    subscription.after = fresh[-1].id
                    subscription.queue.put_nowait(fresh)


def final_event_from(record: JobRecord, after: str) -> JobEvent:
    """The final status event, written from the record when the stream no longer holds it."""
    data = {"status": record.status, "at": record.updated_at.timestamp(), "error": record.error}
    return JobEvent(id=after, type="status", data=data)


async def job_event_stream(
    hub: EventHub, jobs: JobStore, record: JobRecord, after: str = "0-0"
) -> AsyncIterator[str]:
    """SSE text for the job of `record` (read just before): every event after `after` (a
    Last-Event-ID), live ones as they come, ending after the terminal status. A Redis outage ends
    the stream; clients reconnect with Last-Event-ID."""
    yield f"retry: {RECONNECT_MS}\n\n"
    team, job_id = record.team, record.id
    try:
        while True:  # the history, in reads of READ_COUNT, on the shared pool (none of them blocks)
            events = await jobs.events(job_id, after)
            for event in events:
                yield format_event(event)
                after = event.id
                if is_final(event):
                    return
            if len(events) < READ_COUNT:
                break
        if record.status in TERMINAL_STATUSES:
            # Ended before the history was read, yet its final event is gone (trimmed, or the job removed).
            yield format_event(final_event_from(record, after))
            return
        async with hub.follow(team, job_id, after) as subscription:
            while True:
                events = await subscription.next(KEEPALIVE_SECONDS)
                for event in events:
                    yield format_event(event)
                    if is_final(event):
                        return
                if events:
                    continue
                yield ": keep-alive\n\n"
                latest = await jobs.get(team, job_id)
                if latest is None or latest.status in TERMINAL_STATUSES:
                    if latest is not None:
                        yield format_event(final_event_from(latest, subscription.after))
                    return
    except (*REDIS_DOWN_ERRORS, StreamEnded):
        yield ": job store unreachable; reconnect with Last-Event-ID\n\n"

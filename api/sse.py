"""Server-sent events for jobs: one Redis reader per API process, fanned out to every open stream.

A stream used to wait on its own blocking `XREAD`, which holds a pooled Redis connection for as long
as the client listens; about a hundred open streams emptied the pool (100 connections) and every
other route, `/readyz` included, answered 503. Now each stream replays its history with one short
read and then waits on an in-process queue; `EventHub` keeps a single connection of its own that
blocks on the event streams of every followed job at once and hands each new event to the streams
that follow that job. Streams cost memory, not connections, so one process holds thousands.

How many streams a team holds is counted in Redis (`StreamSlots`), not in the process: a stream
takes its slot atomically before its answer starts, so neither concurrent opens nor several API
processes can pass FTC_MAX_STREAMS_PER_TEAM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.jobs import JobStore, events_from_reply
from service.keys import Keys
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
SLOT_LEASE_SECONDS = 30.0
"""How long a stream's slot counts without renewal: what the streams of a killed API process hold on to."""

_TAKE_SLOT = """
local key, token, now, lapses, most = KEYS[1], ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
if redis.call('ZCARD', key) >= most then return 0 end
redis.call('ZADD', key, lapses, token)
redis.call('PEXPIRE', key, ARGV[5])
return 1
"""


def format_event(event: JobEvent) -> str:
    return f"id: {event.id}\nevent: {event.type}\ndata: {json.dumps(event.data, separators=(',', ':'))}\n\n"


def is_final(event: JobEvent) -> bool:
    return event.type == "status" and event.data.get("status") in TERMINAL_STATUSES


def stream_position(event_id: str) -> tuple[int, int]:
    """A Redis stream id (`ms-seq`) as a pair that sorts the way Redis orders entries."""
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)


class StreamSlots:
    """The event streams each team holds open, over every API process, in one sorted set per team
    (`{p}:team:{team}:streams`: a token per stream, scored by when it lapses).

    `take` counts and adds in one script, so the cap holds under any number of concurrent opens.
    This process renews the slots of its open streams every third of SLOT_LEASE_SECONDS and gives
    each back when its stream ends; a process that dies stops renewing, and its slots lapse.
    """

    def __init__(self, redis: Redis, keys: Keys, lease_seconds: float = SLOT_LEASE_SECONDS) -> None:
        self.redis = redis
        self.keys = keys
        self.lease_seconds = lease_seconds
        self._take = redis.register_script(_TAKE_SLOT)
        self._held: dict[str, str] = {}
        """token -> team, of this process's open streams."""
        self._task: asyncio.Task[None] | None = None

    async def take(self, team: str, most: int) -> str | None:
        """A slot for one more stream of `team`, or None when it holds `most` already."""
        token = secrets.token_hex(8)
        now = time.time()
        taken = await self._take(
            keys=[self.keys.streams(team)],
            args=[token, repr(now), repr(now + self.lease_seconds), most, int(self.lease_seconds * 2000)],
        )
        if not taken:
            return None
        self._held[token] = team
        return token

    async def give_back(self, token: str) -> None:
        team = self._held.pop(token, None)
        if team is not None:
            with contextlib.suppress(*REDIS_DOWN_ERRORS):  # unreachable: the slot lapses by itself
                await self.redis.zrem(self.keys.streams(team), token)

    async def held(self, team: str) -> int:
        """Streams `team` holds open now, over every API process."""
        return await self.redis.zcount(self.keys.streams(team), time.time(), "+inf")

    async def renew(self) -> None:
        """Push back the lapse of every slot this process holds (never re-adding one given back)."""
        held = dict(self._held)
        if not held:
            return
        lapses = time.time() + self.lease_seconds
        async with self.redis.pipeline(transaction=False) as pipe:
            for token, team in held.items():
                pipe.zadd(self.keys.streams(team), {token: lapses}, xx=True)
                pipe.pexpire(self.keys.streams(team), int(self.lease_seconds * 2000))
            await pipe.execute()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keep(), name="stream-slots")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for token in list(self._held):
            await self.give_back(token)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await self.renew()
            except REDIS_DOWN_ERRORS as error:  # the streams end on their own; their slots lapse
                log.warning("event streams: could not renew their slots (%s)", error)


class SlotStreamingResponse(StreamingResponse):
    """A streaming answer that gives its stream slot back however it ends: finished, failed, or
    the client gone before the first byte (when the body's own cleanup never runs)."""

    def __init__(self, content: Any, *, on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


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

    @contextlib.asynccontextmanager
    async def follow(self, team: str, job_id: str, after: str) -> AsyncIterator[Subscription]:
        """Follow one job's events after `after`; the caller replays the history itself first."""
        subscription = Subscription(job_id, team, after)
        self._followers.setdefault(job_id, set()).add(subscription)
        self._changed.set()
        try:  # from here on, a client that goes away (cancellation) must not leave its subscription behind
            await self._interrupt_wait(job_id)
            yield subscription
        finally:
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

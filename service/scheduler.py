"""The sweep scheduler (`ftc scheduler`): fires campaigns' cron slots and writes finished runs' reports.

One scheduler is active at a time: it holds a Redis leader lock that expires unless renewed, and
any other scheduler process waits as a standby that takes over within the lock's lifetime when
the active one dies. Each cron slot fires at most once whatever happens: a run is created in the
same atomic step as the slot's marker (SET NX), so neither a second scheduler nor a restart can
fire it again, and a run interrupted while its jobs were being submitted is completed, with the
same jobs, on the next pass. A slot missed while no scheduler ran fires once when one is back;
older missed slots of the same campaign are not replayed one by one.

Every pass also walks the open runs (started by the API or by a slot) and writes the report of
each run whose cells have all ended. Time comes from an injectable clock, so tests can step
through slots; the lock's expiry stays on Redis's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.leader import LeaderLock
from service.redis_client import REDIS_DOWN_ERRORS
from service.reports import write_report
from service.retention import purge_due
from service.runtime import Services
from service.settings import Settings
from service.sweeps import SweepCancelled, SweepRequest, SweepStore
from service.sweeps.cron import latest_slot, next_slot
from service.sweeps.status import counts

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass
class Pass:
    """What one pass did: runs started by a slot, runs whose report was written, and job folders
    whose checkpoints were deleted (FTC_KEEP_CHECKPOINTS, service/retention.py)."""

    fired: list[tuple[str, str]] = field(default_factory=list)
    reported: list[tuple[str, str]] = field(default_factory=list)
    purged: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        services: Services,
        *,
        clock: Clock = time.time,
        name: str | None = None,
        lock_seconds: float = 30.0,
        interval_seconds: float = 5.0,
    ) -> None:
        self.services = services
        self.sweeps = SweepStore(services.redis, services.jobs, teams=services.teams)
        self.clock = clock
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.lock = LeaderLock(services.redis, self.sweeps.keys.scheduler_lock(), self.name, lock_seconds)
        self.interval_seconds = interval_seconds

    async def fire_due(self) -> list[tuple[str, str]]:
        """Start a run for every campaign whose next slot has come; a slot another pass fired is skipped."""
        now = self.clock()
        fired = []
        for sweep_id, _first_due in await self.sweeps.due(now):
            fields = await self.sweeps.sweep_fields(sweep_id)
            if not fields:
                continue
            request = SweepRequest.from_stored(fields["request"])
            if request.schedule is None:
                continue
            slot = latest_slot(request.schedule, request.timezone, now)
            following = next_slot(request.schedule, request.timezone, now)
            try:
                run_id = await self.sweeps.start_run(
                    fields["team"], sweep_id, now, trigger="schedule", slot=slot, following_slot=following
                )
            except SweepCancelled:
                continue
            if run_id is not None:
                log.info("sweep %s: slot %s fired run %s", sweep_id, slot, run_id)
                fired.append((sweep_id, run_id))
        return fired

    async def report_finished(self) -> list[tuple[str, str]]:
        """Finish expanding open runs, and write the report of every run whose cells have all ended."""
        reported = []
        for sweep_id, run_id in await self.sweeps.open_runs():
            try:
                await self.sweeps.expand(sweep_id, run_id)
                context = await self.sweeps.run_context(sweep_id, run_id)
                if context is None or not context.ended:
                    continue
                report = await asyncio.to_thread(write_report, self.services.store, context, self.clock())
                statuses = [cell.status for cell in context.cells]
                await self.sweeps.finish_run(sweep_id, run_id, context.status, counts(statuses), report, self.clock())
            except REDIS_DOWN_ERRORS:
                raise
            except Exception:  # one bad run (a store outage, a broken file) must not stop the others
                log.exception("sweep %s run %s: report failed; retrying on the next pass", sweep_id, run_id)
                continue
            log.info("sweep %s run %s: report written", sweep_id, run_id)
            reported.append((sweep_id, run_id))
        return reported

    async def tick(self) -> Pass:
        """One pass of the active scheduler (the caller holds the lock)."""
        purged = await purge_due(self.services.redis, self.services.store, self.services.settings.key_prefix,
                                 self.clock())
        return Pass(fired=await self.fire_due(), reported=await self.report_finished(), purged=purged)

    async def run(self, stop: asyncio.Event) -> None:
        """Take or wait for the lock, and make a pass every `interval_seconds` while holding it."""
        leading = False
        try:
            while not stop.is_set():
                try:
                    held = await self.lock.acquire_or_renew()
                    if held != leading:
                        log.info("scheduler %s is %s", self.name, "active" if held else "standing by")
                        leading = held
                    if held:
                        async with self.lock.kept():
                            await self.tick()
                except REDIS_DOWN_ERRORS as error:
                    log.warning("scheduler pass skipped, Redis unreachable: %s", error)
                except Exception:
                    log.exception("scheduler pass failed")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.interval_seconds)
        finally:
            with contextlib.suppress(*REDIS_DOWN_ERRORS):
                await self.lock.release()


def run_scheduler(
    settings: Settings, *, interval_seconds: float = 5.0, lock_seconds: float = 30.0, name: str | None = None
) -> None:
    """Run a scheduler until SIGINT or SIGTERM (what `ftc scheduler` does)."""

    async def main() -> None:
        services = Services.open(settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        scheduler = Scheduler(services, name=name, interval_seconds=interval_seconds, lock_seconds=lock_seconds)
        log.info(
            "scheduler %s started (pass every %.1f s, lock %.0f s)", scheduler.name, interval_seconds, lock_seconds
        )
        try:
            await scheduler.run(stop)
        finally:
            await services.close()

    asyncio.run(main())

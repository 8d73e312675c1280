"""The scheduler with an injected clock: each cron slot of a campaign fires exactly once, across
passes, scheduler instances, two scheduler processes, a killed leader and restarts."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pytest

from service.leader import LeaderLock
from service.runtime import Services
from service.scheduler import Scheduler
from service.settings import Settings
from service.sweeps import SweepCancelled, SweepRequest, SweepStore
from service.sweeps.cron import check_schedule, latest_slot, next_slot
from tests.support.servers import ServerProcess, wait_until
from tests.support.service import run_async
from tests.support.sweeps import SWEEP_REQUEST

T0 = datetime(2030, 1, 1, 0, 0, 30, tzinfo=timezone.utc).timestamp()
"""Thirty seconds past midnight; with "*/10 * * * *" the slots are T0 - 30 + k * 600."""
EVERY_TEN_MINUTES = "*/10 * * * *"


def slot(k: int) -> float:
    return T0 - 30 + 600 * k


@pytest.fixture
def settings(service_settings: Callable[..., Settings]) -> Settings:
    return service_settings()


def campaign(schedule: str | None = EVERY_TEN_MINUTES) -> SweepRequest:
    return SweepRequest.model_validate({**SWEEP_REQUEST, "schedule": schedule})


async def create(services: Services, request: SweepRequest, now: float = T0) -> str:
    return await SweepStore(services.redis, services.jobs).create("team-a", request, now)


async def fired_slots(services: Services, sweep_id: str) -> list[float]:
    record = await SweepStore(services.redis, services.jobs).get("team-a", sweep_id)
    return sorted(run.slot.timestamp() for run in record.runs)


# --- cron arithmetic ---------------------------------------------------------------------------


def test_slots_are_read_in_the_campaigns_time_zone() -> None:
    midnight = datetime(2030, 1, 1, tzinfo=timezone.utc).timestamp()
    assert next_slot("0 2 * * *", "UTC", midnight) == midnight + 2 * 3600
    assert next_slot("0 2 * * *", "UTC", midnight + 2 * 3600) == midnight + 26 * 3600  # strictly later
    assert latest_slot("0 2 * * *", "UTC", midnight + 2 * 3600) == midnight + 2 * 3600  # at counts
    assert latest_slot("0 2 * * *", "UTC", midnight + 2 * 3600 - 0.5) == midnight - 22 * 3600
    # 02:00 in Paris is 01:00 UTC in winter and 00:00 UTC in summer.
    winter = datetime(2030, 1, 15, tzinfo=timezone.utc).timestamp()
    summer = datetime(2030, 7, 15, tzinfo=timezone.utc).timestamp()
    assert next_slot("0 2 * * *", "Europe/Paris", winter) == winter + 3600
    assert next_slot("0 2 * * *", "Europe/Paris", summer - 1) == summer
    assert latest_slot("0 2 * * *", "Europe/Paris", summer + 1) == summer


@pytest.mark.parametrize("expression", ["0 2 * * *", " */15  * * * 1-5 ", "@daily", "@hourly"])
def test_cron_expressions_that_are_accepted(expression: str) -> None:
    assert check_schedule(expression) == " ".join(expression.split())


@pytest.mark.parametrize("expression", ["", "every night", "0 2 * *", "0 0 2 * * *", "61 * * * *", "@sometimes"])
def test_cron_expressions_that_are_refused(expression: str) -> None:
    with pytest.raises(ValueError, match="five fields"):
        check_schedule(expression)


# --- one process ---------------------------------------------------------------------------------


def test_a_campaign_fires_once_per_slot_with_an_injected_clock(settings: Settings) -> None:
    async def work(services: Services) -> None:
        sweep_id = await create(services, campaign())
        now = [T0]
        first, second = (Scheduler(services, clock=lambda: now[0], name=n) for n in ("one", "two"))

        assert (await first.tick()).fired == []  # no run before the first slot
        record = await SweepStore(services.redis, services.jobs).get("team-a", sweep_id)
        assert (record.status, record.next_run_at.timestamp()) == ("scheduled", slot(1))

        now[0] = slot(1)
        assert len((await first.tick()).fired) == 1
        assert (await first.tick()).fired == [] and (await second.tick()).fired == []
        now[0] = slot(1) + 599  # still the same slot
        assert (await second.tick()).fired == []
        now[0] = slot(2) + 1
        assert len((await second.tick()).fired) == 1
        assert await fired_slots(services, sweep_id) == [slot(1), slot(2)]

        record = await SweepStore(services.redis, services.jobs).get("team-a", sweep_id)
        assert (record.runs_total, record.run.trigger, len(record.run.cells)) == (2, "schedule", 4)
        assert record.next_run_at.timestamp() == slot(3)

    run_async(settings, work)


def test_after_downtime_the_latest_missed_slot_fires_once_and_older_ones_are_skipped(settings: Settings) -> None:
    async def work(services: Services) -> None:
        sweep_id = await create(services, campaign())
        scheduler = Scheduler(services, clock=lambda: slot(5) + 42)  # slots 1-4 passed unattended
        assert len((await scheduler.tick()).fired) == 1
        assert (await scheduler.tick()).fired == []
        assert await fired_slots(services, sweep_id) == [slot(5)]

    run_async(settings, work)


def test_a_slot_fires_once_even_for_schedulers_that_all_saw_it_due(settings: Settings) -> None:
    """The lock aside: schedulers that read the due list before any of them fired (a paused leader
    and its successor) all try the slot; its marker lets exactly one through."""

    async def work(services: Services) -> None:
        sweep_id = await create(services, campaign())
        store = SweepStore(services.redis, services.jobs)
        assert await store.due(slot(1)) == [(sweep_id, slot(1))]
        tries = [
            store.start_run("team-a", sweep_id, slot(1) + i, trigger="schedule", slot=slot(1), following_slot=slot(2))
            for i in range(4)
        ]
        started = await asyncio.gather(*tries)
        assert sum(run_id is not None for run_id in started) == 1
        late = await store.start_run("team-a", sweep_id, slot(1) + 9, trigger="schedule", slot=slot(1))
        assert late is None
        assert await fired_slots(services, sweep_id) == [slot(1)]
        assert len(await services.redis.zrange(services.jobs.keys.team_jobs("team-a"), 0, -1)) == 4
        schedulers = [Scheduler(services, clock=lambda: slot(2), name=f"s{i}") for i in range(3)]
        assert sum(len(fired) for fired in await asyncio.gather(*(s.fire_due() for s in schedulers))) == 1

    run_async(settings, work)


def test_a_cancelled_campaign_stops_firing(settings: Settings) -> None:
    async def work(services: Services) -> None:
        store = SweepStore(services.redis, services.jobs)
        sweep_id = await create(services, campaign())
        assert await store.cancel("team-a", sweep_id, T0 + 1)
        assert (await Scheduler(services, clock=lambda: slot(3)).tick()).fired == []
        assert await services.redis.zrange(store.keys.scheduled(), 0, -1) == []
        with pytest.raises(SweepCancelled):
            await store.start_run("team-a", sweep_id, T0 + 2)
        assert (await store.get("team-a", sweep_id)).runs_total == 0

    run_async(settings, work)


def test_an_interrupted_expansion_is_finished_with_the_same_jobs(settings: Settings) -> None:
    async def work(services: Services) -> None:
        real_submit, calls = services.jobs.submit, []

        async def submit_then_crash(*args, **kwargs):
            calls.append(args)
            if len(calls) > 1:
                raise ConnectionError("the API process died here")
            return await real_submit(*args, **kwargs)

        services.jobs.submit = submit_then_crash
        with pytest.raises(ConnectionError):
            await create(services, campaign(schedule=None))
        services.jobs.submit = real_submit
        store = SweepStore(services.redis, services.jobs)
        [(sweep_id, run_id)] = await store.open_runs()
        half = (await store.get("team-a", sweep_id)).run.cells
        assert [bool(c.job_id) for c in half] == [True, True, False, False]

        await Scheduler(services, clock=lambda: T0 + 5).tick()
        cells = (await store.get("team-a", sweep_id)).run.cells
        assert [c.job_id for c in cells[:2]] == [c.job_id for c in half[:2]]
        assert all(c.job_id for c in cells) and len({c.job_id for c in cells}) == 4
        assert len(await services.redis.zrange(services.jobs.keys.team_jobs("team-a"), 0, -1)) == 4
        await store.expand(sweep_id, run_id)  # again: nothing new
        assert len(await services.redis.zrange(services.jobs.keys.team_jobs("team-a"), 0, -1)) == 4

    run_async(settings, work)


def test_expanders_running_at_once_make_each_job_once(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API and the scheduler may expand the same run together: they end with the same jobs."""

    async def work(services: Services) -> None:
        store = SweepStore(services.redis, services.jobs)
        real_expand = SweepStore.expand
        monkeypatch.setattr(SweepStore, "expand", lambda *args: asyncio.sleep(0))  # plan only
        three_models = {"models": ["org/a", "org/b", "org/c"]}
        sweep_id = await create(services, campaign(schedule=None).model_copy(update=three_models))
        monkeypatch.setattr(SweepStore, "expand", real_expand)
        [(_sweep, run_id)] = await store.open_runs()
        await asyncio.gather(*(store.expand(sweep_id, run_id) for _ in range(3)))
        cells = (await store.get("team-a", sweep_id)).run.cells
        assert len(cells) == 12 and len({c.job_id for c in cells if c.job_id}) == 12
        assert len(await services.redis.zrange(services.jobs.keys.team_jobs("team-a"), 0, -1)) == 12
        assert await services.redis.hget(store.keys.run(sweep_id, run_id), "state") == "open"

    run_async(settings, work)


def test_the_leader_lock_has_one_holder_and_is_handed_over(settings: Settings) -> None:
    async def work(services: Services) -> None:
        key = f"{settings.key_prefix}:lock-test"
        first = LeaderLock(services.redis, key, "first", ttl_seconds=0.5)
        second = LeaderLock(services.redis, key, "second", ttl_seconds=0.5)
        assert await first.acquire_or_renew() and not await second.acquire_or_renew()
        assert await first.acquire_or_renew()  # renewing keeps it
        await second.release()  # not the holder: does nothing
        assert (await first.holder()).startswith("first:")
        await first.release()
        assert await second.acquire_or_renew() and not await first.acquire_or_renew()
        await asyncio.sleep(0.7)  # the holder died without releasing: the lock expires
        assert await first.acquire_or_renew()
        async with first.kept():  # a long pass keeps the lock past its lifetime
            await asyncio.sleep(1.0)
            assert not await second.acquire_or_renew()

    run_async(settings, work)


# --- two scheduler processes ------------------------------------------------------------------

SCHEDULER_PROCESS = """
import asyncio, signal, sys
from pathlib import Path
from service.runtime import Services
from service.scheduler import Scheduler
from service.settings import Settings

clock_file, name = Path(sys.argv[1]), sys.argv[2]


async def main():
    services = Services.open(Settings())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    clock = lambda: float(clock_file.read_text())
    await Scheduler(services, clock=clock, name=name, lock_seconds=1.0, interval_seconds=0.05).run(stop)
    await services.close()


asyncio.run(main())
"""


def test_two_scheduler_processes_fire_each_slot_exactly_once(settings: Settings, tmp_path: Path) -> None:
    clock_file = tmp_path / "clock"

    def set_clock(now: float) -> None:
        staged = tmp_path / "clock.next"
        staged.write_text(repr(now))
        staged.replace(clock_file)  # atomic: a reader never sees half a number

    set_clock(T0)
    sweep_id = run_async(settings, lambda s: create(s, campaign()))
    env = {
        **os.environ,
        "FTC_REDIS_URL": settings.redis_url,
        "FTC_KEY_PREFIX": settings.key_prefix,
        "FTC_STORE_URL": settings.store_url,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    lock_key = f"{settings.key_prefix}:scheduler:lock"
    redis = settings.redis_url

    def start(name: str) -> ServerProcess:
        command = [sys.executable, "-c", SCHEDULER_PROCESS, str(clock_file), name]
        return ServerProcess(name, command, 0, tmp_path / name, env=env).start(lambda: True)

    def holder() -> str:
        import redis as redis_py

        with redis_py.Redis.from_url(redis, decode_responses=True) as client:
            return (client.get(lock_key) or "").split(":")[0]

    def runs() -> list[float]:
        return run_async(settings, lambda s: fired_slots(s, sweep_id))

    processes = {name: start(name) for name in ("sched-a", "sched-b")}
    try:
        wait_until(lambda: holder() in processes, "a scheduler taking the lock")
        for k in (1, 2, 3):
            for offset in (0, 5, 300, 599):  # several passes at every point of the slot
                set_clock(slot(k) + offset)
                wait_until(lambda k=k: len(runs()) == k, f"slot {k} firing")
        leader = holder()
        processes[leader].kill()  # the active scheduler dies without releasing its lock
        standby = next(name for name in processes if name != leader)
        for k in (4, 5):
            set_clock(slot(k) + 1)
            wait_until(lambda k=k: len(runs()) == k, f"slot {k} firing after the failover")
        assert holder() == standby
        processes[leader] = start(leader)  # restarted: it must not fire slot 5 again
        for k in (6, 7):
            for offset in (1, 200):
                set_clock(slot(k) + offset)
                wait_until(lambda k=k: len(runs()) == k, f"slot {k} firing")
        set_clock(slot(7) + 599)
        processes[holder()].stop()  # a clean stop hands the lock over at once
        wait_until(lambda: holder() in processes and processes[holder()].process.poll() is None, "the handover")
        assert runs() == [slot(k) for k in range(1, 8)]
    finally:
        for process in processes.values():
            process.stop()
    assert runs() == [slot(k) for k in range(1, 8)]

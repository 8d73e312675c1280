"""Shared layer plans (service/plans.py) with the real Redis and moto's S3 server: measured once among
concurrent workers, taken over from a dead holder, kept while a long measurement renews its lease,
measured again when the kept file cannot be read."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.keys import Keys
from service.plans import PlanLease, SharedPlans, list_plans, read_plan
from service.redis_client import connect_sync
from service.settings import Settings
from service.store import store_for
from service.store.layout import plan_object

TEAM = "team-a"
pytestmark = pytest.mark.timeout(60)
KEY = "ab" * 32
ENTRIES = [{"layer": 0, "unit": "attention", "ratios": [0.1, 0.3], "errors": [0.5, 0.25], "divergence": 0.01,
            "reference_error": 0.25}]
ABOUT = {"model": "smollm2-135m", "method": "ftc", "scope": "attention", "job_id": "job_x"}


class Measure:
    """A measurement that takes `seconds` and counts how often it ran."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.calls = seconds, 0
        self._lock = threading.Lock()

    def __call__(self) -> list[dict]:
        with self._lock:
            self.calls += 1
        time.sleep(self.seconds)
        return [dict(entry) for entry in ENTRIES]


def as_is(entries: list[dict]) -> list[dict]:
    return entries


@pytest.fixture
def settings(service_settings: Callable[..., Settings]) -> Settings:
    return service_settings("s3")


def shared(settings: Settings, holder: str, lease_seconds: float = 5.0, **extra) -> SharedPlans:
    return SharedPlans(store_for(settings), connect_sync(settings), Keys(settings.key_prefix), TEAM, ABOUT,
                       lease_seconds=lease_seconds, holder=holder, poll_first_seconds=0.05, poll_max_seconds=0.2,
                       **extra)


def test_two_workers_that_start_one_plan_at_once_measure_it_once(settings: Settings) -> None:
    measure = Measure(seconds=0.5)
    workers = [shared(settings, f"worker-{n}") for n in range(2)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda plans: plans.get(KEY, measure, as_is), workers))
    assert measure.calls == 1
    assert results == [ENTRIES, ENTRIES]
    kept = read_plan(store_for(settings), TEAM, KEY)
    assert kept is not None and kept["entries"] == ENTRIES and kept["job_id"] == "job_x"
    assert connect_sync(settings).get(Keys(settings.key_prefix).plan_lease(TEAM, KEY)) is None, "lease let go"
    # a later job (another ratio of the same sweep) reads it
    assert shared(settings, "worker-2").get(KEY, measure, as_is) == ENTRIES and measure.calls == 1


def test_a_dead_holders_lease_expires_and_the_next_worker_measures(settings: Settings) -> None:
    client = connect_sync(settings)
    dead = PlanLease(client, Keys(settings.key_prefix).plan_lease(TEAM, KEY), "dead-worker", seconds=0.8)
    assert dead.acquire()  # and never renews, nor writes the plan
    stages: list[str] = []
    measure = Measure()
    started = time.monotonic()
    assert shared(settings, "next", report=stages.append).get(KEY, measure, as_is) == ENTRIES
    assert measure.calls == 1 and time.monotonic() - started >= 0.7
    assert stages == ["waiting for plan", "planning"]


def test_a_measurement_longer_than_its_lease_keeps_it_by_renewing(settings: Settings) -> None:
    measure = Measure(seconds=2.0)
    first, second = shared(settings, "first", lease_seconds=0.8), shared(settings, "second", lease_seconds=0.8)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(first.get, KEY, measure, as_is)
        time.sleep(0.2)
        waiting = pool.submit(second.get, KEY, measure, as_is)
        assert running.result() == waiting.result() == ENTRIES
    assert measure.calls == 1


def test_a_waiting_job_stops_when_told_and_leaves_the_lease_to_its_holder(settings: Settings) -> None:
    lease = PlanLease(connect_sync(settings), Keys(settings.key_prefix).plan_lease(TEAM, KEY), "holder", 30)
    assert lease.acquire()

    class Cancelled(Exception):
        pass

    def cancelled() -> None:
        raise Cancelled

    with pytest.raises(Cancelled):
        shared(settings, "waiter", check=cancelled).get(KEY, Measure(), as_is)
    assert lease.holder_now() == "holder"


def test_an_unreadable_plan_is_measured_again_and_replaced(settings: Settings) -> None:
    store = store_for(settings)
    measure = Measure()

    def strict(entries: list[dict]) -> list[dict]:
        if any(set(entry) != set(ENTRIES[0]) for entry in entries):
            raise ValueError("not a plan of this version")
        return entries

    for bad in (b"{not json", json.dumps({"entries": "none"}).encode(), json.dumps({"entries": [{"x": 1}]}).encode()):
        store.put_bytes(plan_object(TEAM, KEY), bad)
        assert shared(settings, "w").get(KEY, measure, strict) == ENTRIES
    assert measure.calls == 3
    assert json.loads(store.get_bytes(plan_object(TEAM, KEY)))["entries"] == ENTRIES


def test_the_listing_describes_each_plan_from_its_file(settings: Settings) -> None:
    store = store_for(settings)
    shared(settings, "w").get(KEY, Measure(), as_is)
    store.put_bytes(plan_object(TEAM, "cd" * 32), b"{not json")
    store.put_bytes(plan_object("team-b", "ef" * 32), b"{}")
    listed = {plan.key: plan for plan in list_plans(store, TEAM)}
    assert set(listed) == {KEY, "cd" * 32}
    plan = listed[KEY]
    assert (plan.model, plan.method, plan.scope, plan.job_id) == ("smollm2-135m", "ftc", "attention", "job_x")
    assert plan.bytes == len(store.get_bytes(plan_object(TEAM, KEY)))
    assert listed["cd" * 32].model is None and listed["cd" * 32].bytes == len(b"{not json")

"""Layer plans of `allocation: sensitivity`, kept in the object store and shared by every worker.

A plan is the layer list of ftc-method.md §15: per decoder layer and unit (attention, MLP), the
predicted error curve and the divergence measured with that unit alone compressed. It depends on
the model's content, the calibration, the method with its fixed choices and the scope, never on
rho, and `ftc.compression.sensitivity.plan_key` names it by a digest of those. Measuring one costs a few dense
passes; reading one costs a GET. So the service keeps each at `{team}/plans/{key}.json`
(`{"entries": [...], "model": ..., "method": ..., "scope": ..., "created": ..., "job_id": ...}`):
every ratio of a sweep, every retry and every later job of the team plans from the same file.

Two workers that start the same plan at once measure it once. The first takes a lease in Redis
(`{prefix}:plan:{team}:{key}`, `FTC_LEASE_SECONDS`, renewed while it measures, as a job's lease
is), writes the plan atomically (one PUT) and lets the lease go; the others poll the store with
backoff until the plan is there. A holder that dies stops renewing: its lease expires and the
next poller takes it over and measures. Without Redis a worker measures alone rather than fail.

Torch-free: the workers adapt this to the library's `ftc.compression.sensitivity.PlanStore` (workers/plans.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from typing import Any, TypeVar

import redis
from pydantic import BaseModel, Field

from service.keys import Keys
from service.redis_client import REDIS_DOWN_ERRORS
from service.store import ObjectMissing, ObjectStore
from service.store.layout import plan_object, plans_prefix

log = logging.getLogger(__name__)

T = TypeVar("T")

PLAN_KEY_PATTERN = r"^[0-9a-f]{64}$"
"""A plan's name: the sha256 hex digest `ftc.compression.sensitivity.plan_key` gives."""
POLL_FIRST_SECONDS = 0.5
"""First wait of a worker whose plan another is measuring; doubles up to POLL_MAX_SECONDS."""
POLL_MAX_SECONDS = 10.0
"""Longest wait between two looks for a plan being measured (measuring takes minutes)."""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class PlanInfo(BaseModel):
    """A plan as GET /v1/plans lists it."""

    key: str = Field(..., description="The plan's name: a digest of model content, calibration, method and scope.")
    model: str | None = Field(None, description="The model of the job that measured it.")
    method: str | None = None
    scope: str | None = None
    created: datetime = Field(..., description="When it was measured (the file's time if it does not say).")
    bytes: int
    job_id: str | None = Field(None, description="The job that measured it.")


class PlanList(BaseModel):
    plans: list[PlanInfo]


def plan_document(key: str, entries: list[dict], about: Mapping[str, Any], seconds: float) -> bytes:
    """The JSON a plan is kept as: its entries and who measured it, for what, when and how long."""
    document = {"key": key, **about, "created": datetime.now(timezone.utc).isoformat(),
                "measure_seconds": round(seconds, 3), "entries": entries}
    return json.dumps(document, indent=1).encode()


def read_plan(store: ObjectStore, team: str, key: str) -> dict | None:
    """The team's plan `key` as kept, or None when there is none or it cannot be read (it is measured
    again and replaced: a half-written or foreign file must not decide the budgets)."""
    try:
        document = json.loads(store.get_bytes(plan_object(team, key)))
    except ObjectMissing:
        return None
    except ValueError:
        log.warning("plan %s of team %s is not JSON; measuring it again", key, team)
        return None
    if not isinstance(document, dict) or not isinstance(document.get("entries"), list):
        log.warning("plan %s of team %s has no list of entries; measuring it again", key, team)
        return None
    return document


def _info(key: str, size: int, modified: datetime, document: Any) -> PlanInfo:
    about = document if isinstance(document, dict) else {}

    def text(name: str) -> str | None:
        value = about.get(name)
        return value if isinstance(value, str) else None

    try:
        created = datetime.fromisoformat(about["created"])
    except (KeyError, TypeError, ValueError):
        created = modified
    if created.tzinfo is None:
        created = created.replace(tzinfo=timezone.utc)
    return PlanInfo(key=key, model=text("model"), method=text("method"), scope=text("scope"), created=created,
                    bytes=size, job_id=text("job_id"))


def list_plans(store: ObjectStore, team: str) -> list[PlanInfo]:
    """The team's plans, newest first, each described from its own file (one GET each)."""
    plans = []
    prefix = plans_prefix(team)
    for item in store.list(prefix):
        key = item.key[len(prefix):].removesuffix(".json")
        if "/" in key or not item.key.endswith(".json"):
            continue
        try:
            document = json.loads(store.get_bytes(item.key))
        except (ObjectMissing, ValueError):  # deleted meanwhile, or unreadable: listed by what the store says
            document = None
        plans.append(_info(key, item.size, item.modified, document))
    return sorted(plans, key=lambda plan: plan.created, reverse=True)


def delete_plan(store: ObjectStore, team: str, key: str) -> PlanInfo | None:
    """Delete the team's plan `key`; returns what it was, or None when the team has no such plan."""
    found = [item for item in store.list(plan_object(team, key)) if item.key == plan_object(team, key)]
    if not found:
        return None
    try:
        document = json.loads(store.get_bytes(found[0].key))
    except (ObjectMissing, ValueError):
        document = None
    store.delete(found[0].key)
    return _info(key, found[0].size, found[0].modified, document)


class PlanLease:
    """Who measures plan `key` now: a Redis string holding the holder's name, expiring unless renewed."""

    def __init__(self, client: redis.Redis, name: str, holder: str, seconds: float) -> None:
        self.client, self.name, self.holder = client, name, holder
        self.milliseconds = max(1, int(seconds * 1000))

    def acquire(self) -> bool:
        return bool(self.client.set(self.name, self.holder, nx=True, px=self.milliseconds))

    def renew(self) -> bool:
        return bool(self.client.eval(_RENEW, 1, self.name, self.holder, self.milliseconds))

    def release(self) -> None:
        self.client.eval(_RELEASE, 1, self.name, self.holder)

    def holder_now(self) -> str | None:
        return self.client.get(self.name)


@contextmanager
def renewing(lease: PlanLease, every_seconds: float) -> Iterator[None]:
    """Renew `lease` every `every_seconds` in a thread while the body runs (measuring takes minutes)."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(every_seconds):
            try:
                if not lease.renew():
                    log.warning("lost the lease of plan %s; measuring on (the plan is the same whoever writes it)",
                                lease.name)
                    return
            except REDIS_DOWN_ERRORS as error:  # keep trying while the lease lasts
                log.warning("could not renew the lease of plan %s (%s)", lease.name, error)

    thread = threading.Thread(target=renew, name="plan-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class SharedPlans:
    """The plans of one team's job: read from the store, or measured once among all workers and kept.

    `about` describes the plan for people (model, method, scope, job id: what GET /v1/plans shows);
    `check` is called between polls and may raise to stop waiting (the job was cancelled);
    `report(stage)` says what the job is doing meanwhile (`planning`, `waiting for plan`).
    """

    def __init__(
        self,
        store: ObjectStore,
        client: redis.Redis,
        keys: Keys,
        team: str,
        about: Mapping[str, Any],
        *,
        lease_seconds: float,
        holder: str | None = None,
        check: Callable[[], None] = lambda: None,
        report: Callable[[str], None] = lambda stage: None,
        poll_first_seconds: float = POLL_FIRST_SECONDS,
        poll_max_seconds: float = POLL_MAX_SECONDS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store, self.client, self.keys, self.team, self.about = store, client, keys, team, dict(about)
        self.lease_seconds = lease_seconds
        self.holder = holder or f"plan-{uuid.uuid4().hex[:12]}"
        self.check, self.report, self.sleep = check, report, sleep
        self.poll_first_seconds, self.poll_max_seconds = poll_first_seconds, poll_max_seconds

    def get(self, key: str, measure: Callable[[], list[dict]], decode: Callable[[list[dict]], T]) -> T:
        """The plan `key`, decoded: the kept one, else measured here (once among every worker) and kept.

        `decode` turns the kept entries into what the caller uses, raising ValueError, TypeError or
        KeyError when it cannot (a plan of another library version): such a plan is measured again.
        The entries measured here are decoded from their JSON too, so this worker plans from exactly
        what the others will read."""
        lease = PlanLease(self.client, self.keys.plan_lease(self.team, key), self.holder, self.lease_seconds)
        delay, waited = self.poll_first_seconds, False
        while True:
            found = self._read(key, decode)
            if found is not None:
                return found
            held = self._acquire(lease)
            if held is not False:
                try:
                    found = self._read(key, decode)  # written between our look and our lease
                    if found is not None:
                        return found
                    return decode(self._measure(key, lease if held else None, measure))
                finally:
                    if held:
                        self._release(lease)
            if not waited:
                log.info("plan %s is being measured by %s; waiting for it", key, self._holder(lease))
                self.report("waiting for plan")
                waited = True
            self.check()
            self.sleep(delay)
            delay = min(2 * delay, self.poll_max_seconds)

    def _read(self, key: str, decode: Callable[[list[dict]], T]) -> T | None:
        document = read_plan(self.store, self.team, key)
        if document is None:
            return None
        try:
            found = decode(document["entries"])
        except (ValueError, TypeError, KeyError) as error:
            log.warning("plan %s cannot be read (%s); measuring it again", key, error)
            return None
        log.info("plan %s read from the object store (measured by job %s)", key, document.get("job_id"))
        return found

    def _measure(self, key: str, lease: PlanLease | None, measure: Callable[[], list[dict]]) -> list[dict]:
        self.report("planning")
        log.info("measuring plan %s", key)
        started = time.monotonic()
        with renewing(lease, self.lease_seconds / 4) if lease is not None else nullcontext():
            entries = measure()
        seconds = time.monotonic() - started
        document = plan_document(key, entries, self.about, seconds)
        self.store.put_bytes(plan_object(self.team, key), document, "application/json")
        log.info("plan %s measured in %.1f s and kept (%d bytes)", key, seconds, len(document))
        return json.loads(document)["entries"]

    def _acquire(self, lease: PlanLease) -> bool | None:
        """True: ours; False: another worker's; None: Redis is down, so measure without one (the plan
        is the same whoever measures it: a second measurement costs time, a failed job more)."""
        try:
            return lease.acquire()
        except REDIS_DOWN_ERRORS as error:
            log.warning("Redis unreachable (%s); measuring plan %s without a lease", error, lease.name)
            return None

    def _release(self, lease: PlanLease) -> None:
        try:
            lease.release()
        except REDIS_DOWN_ERRORS as error:  # it expires
            log.warning("could not release the lease of plan %s (%s)", lease.name, error)

    def _holder(self, lease: PlanLease) -> str:
        try:
            return lease.holder_now() or "another worker"
        except REDIS_DOWN_ERRORS:
            return "another worker"

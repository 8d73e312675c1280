"""Shared layer plans on the worker: the library's UnitCurve through the plan's JSON, and a job set
over two ratios with allocation 'sensitivity' that measures its plan once (in process, real Redis,
a tiny model)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest
import torch

from ftc.compression.sensitivity import UnitCurve
from service.keys import Keys
from service.plans import SharedPlans
from service.redis_client import connect_sync
from service.runtime import Services
from service.store import LocalStore
from service.store.layout import job_prefix, plan_object, plans_prefix
from tests.support.service import run_async
from tests.support.workers import worker_job_request
from tests.workers.test_job import Worker, ended, submit, wait_for
from workers.plans import StorePlans

TEAM = "team-a"
KEY = "d4" * 32
CURVES = [
    UnitCurve(layer=0, unit="attention", ratios=(0.1, 0.3, 0.9), errors=(0.71, 0.33, 0.012), divergence=0.0123456789012,
              reference_error=0.33),
    UnitCurve(layer=0, unit="mlp", ratios=(0.1, 0.3, 0.9), errors=(0.8, 0.4, 0.02), divergence=1e-7,
              reference_error=0.4),
]
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """The worker sets torch's thread count for its process; give the test process its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_unit_curves_round_trip_through_the_plans_json(worker_settings) -> None:
    settings = worker_settings()
    store = LocalStore(settings.store_url)

    def plans(ready=lambda: None) -> StorePlans:
        shared = SharedPlans(store, connect_sync(settings), Keys(settings.key_prefix), TEAM, {"job_id": "job_x"},
                             lease_seconds=5)
        return StorePlans(shared, ready)

    measured: list[int] = []
    ready: list[int] = []
    first = plans(lambda: ready.append(1))
    assert first.curves(KEY, lambda: measured.append(1) or CURVES) == CURVES  # tuples again, floats exact
    assert first.keys == [KEY] and ready == [1]
    kept = json.loads(store.get_bytes(plan_object(TEAM, KEY)))["entries"]
    assert kept == [json.loads(json.dumps(dataclasses.asdict(curve))) for curve in CURVES]
    assert plans().curves(KEY, lambda: pytest.fail("a kept plan is read, not measured")) == CURVES

    store.put_bytes(plan_object(TEAM, KEY), json.dumps({"entries": [{"layer": 0, "unit": "attention"}]}).encode())
    assert plans().curves(KEY, lambda: measured.append(1) or CURVES) == CURVES  # another version's: measured again
    assert len(measured) == 2


def test_a_job_set_over_two_ratios_measures_its_plan_once(worker_settings, models_dir) -> None:
    settings = worker_settings()
    _root, model = models_dir(layers=2)
    request = worker_job_request(model, allocation="sensitivity", scope="model",
                                 eval={"datasets": [], "seq_len": 64}) | {"ratio": None, "ratios": [0.5, 0.7]}

    async def scenario(services: Services) -> list:
        first = await submit(services, request)
        record = await services.jobs.require(TEAM, first)
        async with Worker(settings):
            ended_records = [await wait_for(services, job_id, ended) for job_id in (first, *record.linked)]
        return [(r, await services.jobs.events(r.id)) for r in ended_records]

    results = run_async(settings, scenario)
    store = LocalStore(settings.store_url)
    (plan,) = store.list(plans_prefix(TEAM))
    document = json.loads(store.get_bytes(plan.key))
    key = plan.key.removeprefix(plans_prefix(TEAM)).removesuffix(".json")
    measured_by = document["job_id"]
    assert (document["model"], document["method"], document["scope"]) == (model, "ftc", "model")
    for record, events in results:
        assert record.status == "succeeded", record.error
        metrics = json.loads(store.get_bytes(job_prefix(TEAM, record.id) + "metrics.json"))
        assert (metrics["plan_key"], metrics["allocation"], metrics["scope"]) == (key, "sensitivity", "model")
        assert metrics["storage"]["scope"] == "model" and set(metrics["storage"]["parts"]) >= {"qkv", "gateup"}
        assert metrics["bytes_written"] > 0
        stages = [e.data["stage"] for e in events if e.type == "progress"]
        log = store.get_bytes(job_prefix(TEAM, record.id) + "log.txt").decode()
        if record.id == measured_by:
            assert "planning" in stages and f"measuring plan {key}" in log
        else:
            assert "planning" not in stages and f"plan {key} read from the object store" in log
    assert measured_by in [record.id for record, _ in results]

"""FTC_KEEP_CHECKPOINTS through the worker loop (real Redis, a local-folder store, a tiny model):
a succeeded job's checkpoints are marked for deletion a week on by default, or deleted at once."""

from __future__ import annotations

import pytest

from service.retention import expiry_key
from service.store.layout import job_prefix
from tests.support.workers import worker_job_request
from tests.workers.test_job import TEAM, run, run_job, store_names

pytestmark = pytest.mark.timeout(240)


def test_a_succeeded_jobs_checkpoints_are_marked_for_deletion_or_deleted_at_once(worker_settings, models_dir) -> None:
    _root, model = models_dir(layers=2)
    request = worker_job_request(model, eval={"datasets": []})
    kept = worker_settings()
    record = run_job(kept, request)
    assert record.status == "succeeded", record.error
    assert [n for n in store_names(kept, record.id) if n.startswith("checkpoints/layer-")]
    due = run(kept, lambda services: services.redis.zscore(expiry_key(kept.key_prefix), job_prefix(TEAM, record.id)))
    assert due == pytest.approx(record.finished_at.timestamp() + 7 * 86400, abs=60)

    at_once = worker_settings(keep_checkpoints="0")
    record = run_job(at_once, request)
    assert record.status == "succeeded", record.error
    names = store_names(at_once, record.id)
    assert "model.safetensors" in names and not [n for n in names if n.startswith("checkpoints/")]

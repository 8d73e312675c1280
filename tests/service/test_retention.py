"""FTC_KEEP_CHECKPOINTS: a succeeded job's checkpoints are marked for deletion and deleted once due
(real Redis, a local-folder store), and the listing separates them from the outputs."""

from __future__ import annotations

import pytest

from service.artifacts import artifact_kind
from service.retention import after_success, expiry_key, parse_keep, purge_due
from service.store import LocalStore
from service.store.layout import checkpoint_name, job_prefix
from tests.support.service import run_async
from workers.settings import WorkerSettings


def test_keep_is_a_duration_or_forever() -> None:
    assert [parse_keep(t) for t in ("0", "3600", "90m", "12h", "7d", "1.5h", "forever", " 30s ")] == [
        0, 3600, 5400, 43200, 604800, 5400, None, 30,
    ]  # fmt: skip
    for bad in ("", "-1", "7 days", "1w", "never"):
        with pytest.raises(ValueError, match="FTC_KEEP_CHECKPOINTS must be a duration"):
            parse_keep(bad)


def test_the_worker_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTC_KEEP_CHECKPOINTS", "12h")
    assert WorkerSettings().keep_checkpoints_seconds == 43200
    monkeypatch.setenv("FTC_KEEP_CHECKPOINTS", "a week")
    with pytest.raises(ValueError, match="FTC_KEEP_CHECKPOINTS must be a duration"):
        WorkerSettings()


def test_artifact_kinds() -> None:
    names = ["model.safetensors", "manifest.json", "config.json", "dense/model.safetensors", "metrics.json",
             "log.txt", checkpoint_name(3), "checkpoints/fingerprint.json"]
    assert [artifact_kind(n) for n in names] == [
        "model", "model", "model", "dense", "record", "record", "checkpoint", "checkpoint",
    ]  # fmt: skip


def test_checkpoints_are_deleted_when_due_and_not_before(service_settings) -> None:
    settings = service_settings()
    store = LocalStore(settings.store_url)
    folders = {name: job_prefix("team-a", f"job_{name}") for name in ("now", "later", "kept")}
    for prefix in folders.values():
        for layer in range(3):
            store.put_bytes(prefix + checkpoint_name(layer), b"weights")
        store.put_bytes(prefix + "model.safetensors", b"model")

    def checkpoints(name: str) -> int:
        return len(store.list(folders[name] + "checkpoints/"))

    async def scenario(services) -> list[list[str]]:
        prefix = settings.key_prefix
        await after_success(services.redis, store, prefix, folders["now"], 0, now=1000.0)
        await after_success(services.redis, store, prefix, folders["later"], 3600, now=1000.0)
        await after_success(services.redis, store, prefix, folders["kept"], None, now=1000.0)
        early = await purge_due(services.redis, store, prefix, now=1000.0 + 3599)
        due = await purge_due(services.redis, store, prefix, now=1000.0 + 3600)
        again = await purge_due(services.redis, store, prefix, now=1000.0 + 7200)
        assert await services.redis.zcard(expiry_key(prefix)) == 0
        return [early, due, again]

    assert checkpoints("now") == 3
    early, due, again = run_async(settings, scenario)
    assert (early, due, again) == ([], [folders["later"]], [])
    assert (checkpoints("now"), checkpoints("later"), checkpoints("kept")) == (0, 0, 3)
    assert all(store.get_bytes(prefix + "model.safetensors") == b"model" for prefix in folders.values())

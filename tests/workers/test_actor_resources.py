"""Custom Ray resources keep the worker actors on the nodes that offer them (FTC_ACTOR_RESOURCES)."""

from __future__ import annotations

import pytest

from workers.settings import WorkerSettings
from workers.supervisor import place


def test_actors_ask_for_the_custom_resources_the_settings_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTC_ACTOR_RESOURCES", '{"ftc_worker_node": 1}')
    settings = WorkerSettings(device="cpu")
    assert place(settings, 2, cluster_gpus=0).resources == {
        "num_gpus": 0, "num_cpus": 1, "resources": {"ftc_worker_node": 1.0}
    }
    gpu = place(settings.model_copy(update={"device": "cuda"}), None, cluster_gpus=2)
    assert gpu.count == 2 and gpu.resources["resources"] == {"ftc_worker_node": 1.0}
    monkeypatch.delenv("FTC_ACTOR_RESOURCES")
    assert "resources" not in place(WorkerSettings(device="cpu"), 1, cluster_gpus=0).resources

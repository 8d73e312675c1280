"""`ftc serve` with several uvicorn processes: the prometheus_client multiprocess folder is made and
emptied before they start, so counts of an earlier run are not added to this one's."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.server import reset_multiprocess_metrics


def test_the_multiprocess_folder_is_created_and_emptied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "metrics"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    reset_multiprocess_metrics()
    assert folder.is_dir() and not any(folder.iterdir())
    (folder / "counter_123.db").write_bytes(b"old")
    (folder / "histogram_456.db").write_bytes(b"old")
    (folder / "notes.txt").write_text("not ours")
    reset_multiprocess_metrics()
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    reset_multiprocess_metrics()  # not set: nothing to do

"""One result row per cell, read from the `metrics.json` each job leaves in the store.

The contract with the workers (docs/sweeps.md): `{team}/jobs/{job_id}/metrics.json` holds

    {"perplexity": {"wikitext2": {"ppl": 31.2, ...}, ...},        one entry per eval dataset
     "dense_perplexity": {"wikitext2": {"ppl": 29.9, ...}, ...},  when eval.dense_reference was set
     "downstream": {"tasks": {"arc_easy": {"acc": 0.61, ...}, "gsm8k": {"exact_match": 0.02, ...}},
                    "avg": 0.48, ...},                            when eval.tasks was set
     "dense_downstream": {...},                                   the same for the dense model
     "allocation": "uniform", "scope": "attention",               what the job ran
     "storage": {"attention_bytes_written": ..., "linear_reduction": ..., "model_reduction": ...,
                 "source_bytes": ...},                             the manifest's accounting
     "bytes_written": ...,                                         the artifact's weights file
     "timings": {"total_seconds": ...}}

A perplexity entry may also be a bare number. Anything missing leaves its cell empty instead of
failing the report: a table with a gap is more useful than no table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.store import ObjectMissing, ObjectStore
from service.store.layout import METRICS, job_prefix
from service.sweeps.schemas import variant_label
from service.sweeps.store import RunCell

AVERAGE = "avg"
"""The accuracy key of the mean over a job's tasks, next to the task names."""


@dataclass(frozen=True)
class CellMetrics:
    perplexity: dict[str, float] = field(default_factory=dict)
    dense_perplexity: dict[str, float] = field(default_factory=dict)
    accuracy: dict[str, float] = field(default_factory=dict)
    """Each task's headline score (acc; exact match for gsm8k) and their mean under `avg`."""
    dense_accuracy: dict[str, float] = field(default_factory=dict)
    allocation: str | None = None
    scope: str | None = None
    bytes_written: int | None = None
    source_bytes: int | None = None
    attention_bytes: int | None = None
    linear_reduction: float | None = None
    model_reduction: float | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class ResultRow:
    """A cell of the result table: what was run, how it ended and what it measured."""

    model: str
    method: str
    ratio: float
    status: str
    job_id: str | None = None
    perplexity: dict[str, float] = field(default_factory=dict)
    ratio_to_dense: dict[str, float] = field(default_factory=dict)
    accuracy: dict[str, float] = field(default_factory=dict)
    allocation: str | None = None
    scope: str | None = None
    bytes_written: int | None = None
    """The artifact's weights file."""
    source_bytes: int | None = None
    """The source checkpoint's weights, for the size the artifact saves."""
    attention_bytes: int | None = None
    linear_reduction: float | None = None
    """The share of the decoder's seven linear projections removed: the ratio the SVD papers quote."""
    model_reduction: float | None = None
    seconds: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ResultRow:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)


def _perplexity(value: Any) -> float | None:
    if isinstance(value, Mapping):
        value = value.get("ppl")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def _per_dataset(section: Any) -> dict[str, float]:
    if not isinstance(section, Mapping):
        return {}
    found = {name: _perplexity(value) for name, value in section.items()}
    return {name: value for name, value in found.items() if value is not None}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and math.isfinite(number) else None


def _name(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _accuracy(section: Any) -> dict[str, float]:
    """Task -> headline score from a `downstream` section, plus `avg`; malformed entries are left out."""
    if not isinstance(section, Mapping) or not isinstance(section.get("tasks"), Mapping):
        return {}
    found: dict[str, float | None] = {}
    for task, row in section["tasks"].items():
        if isinstance(row, Mapping):
            found[task] = _number(row.get("acc", row.get("exact_match")))
    found[AVERAGE] = _number(section.get(AVERAGE))
    return {name: value for name, value in found.items() if value is not None and math.isfinite(value)}


def parse_metrics(data: Any) -> CellMetrics:
    """Read a metrics.json document; unknown or malformed parts are left out."""
    if not isinstance(data, Mapping):
        return CellMetrics()
    storage = data.get("storage") if isinstance(data.get("storage"), Mapping) else {}
    timings = data.get("timings") if isinstance(data.get("timings"), Mapping) else {}
    return CellMetrics(
        perplexity=_per_dataset(data.get("perplexity")),
        dense_perplexity=_per_dataset(data.get("dense_perplexity")),
        accuracy=_accuracy(data.get("downstream")),
        dense_accuracy=_accuracy(data.get("dense_downstream")),
        allocation=_name(data.get("allocation")),
        scope=_name(storage.get("scope", data.get("scope"))),
        bytes_written=_count(data.get("bytes_written")),
        source_bytes=_count(storage.get("source_bytes")),
        attention_bytes=_count(storage.get("attention_bytes_written")),
        linear_reduction=_number(storage.get("linear_reduction")),
        model_reduction=_number(storage.get("model_reduction")),
        seconds=_number(timings.get("total_seconds")),
    )


STORAGE_FIELDS = ("allocation", "scope", "bytes_written", "source_bytes", "attention_bytes", "linear_reduction",
                  "model_reduction")
"""What a row takes from its job's metrics as they are (what ran, what it stored)."""


def _storage_of(found: CellMetrics | None) -> dict[str, Any]:
    return {name: getattr(found, name) if found else None for name in STORAGE_FIELDS}


def read_metrics(store: ObjectStore, team: str, job_id: str) -> CellMetrics | None:
    """The job's metrics, or None when it left no readable metrics.json."""
    try:
        return parse_metrics(json.loads(store.get_bytes(job_prefix(team, job_id) + METRICS)))
    except (ObjectMissing, ValueError):
        return None


def result_rows(
    store: ObjectStore, team: str, cells: list[RunCell]
) -> tuple[list[ResultRow], dict[str, dict], dict[str, dict]]:
    """The rows of a run (in cell order), the dense perplexity per model and dataset, and the dense
    accuracy per model and task."""
    metrics = {
        cell.planned.job_id: read_metrics(store, team, cell.planned.job_id)
        for cell in cells
        if cell.planned.job_id and cell.status == "succeeded"
    }
    dense: dict[str, dict[str, float]] = {}
    dense_accuracy: dict[str, dict[str, float]] = {}
    for cell in cells:
        found = metrics.get(cell.planned.job_id)
        if found is not None and found.dense_perplexity:
            dense.setdefault(cell.planned.model, found.dense_perplexity)
        if found is not None and found.dense_accuracy:
            dense_accuracy.setdefault(cell.planned.model, found.dense_accuracy)
    rows = []
    for cell in cells:
        planned, state = cell.planned, cell.state
        found = metrics.get(planned.job_id)
        reference = dense.get(planned.model, {})
        error = state.error if state else None
        if cell.status == "succeeded" and found is None:
            error = "the job left no readable metrics.json"
        seconds = found.seconds if found else None
        if seconds is None and state and state.started_at and state.finished_at:
            seconds = state.finished_at - state.started_at
        perplexity = found.perplexity if found else {}
        rows.append(
            ResultRow(
                model=planned.model,
                method=variant_label(planned.method, planned.ablate),
                ratio=planned.ratio,
                status=cell.status,
                job_id=planned.job_id,
                perplexity=perplexity,
                ratio_to_dense={d: p / reference[d] for d, p in perplexity.items() if d in reference},
                accuracy=found.accuracy if found else {},
                **_storage_of(found),
                seconds=round(seconds, 3) if seconds is not None else None,
                error=error,
            )
        )
    return rows, dense, dense_accuracy

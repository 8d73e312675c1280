"""What goes over the wire: job requests, job records, progress, events, artifacts and uploads.

Validation lives here so the API answers bad input with a 422 that names the field, and so the
workers can trust every stored request. Names come from `ftc.options`, shared with the library.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ftc.options import DATASETS, METHODS, parse_ablations, validate_ratio
from ftc.tasks import TASKS, parse_tasks

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")
"""Highest first: the order in which workers look for work."""

MAX_RATIOS = 32
UPLOAD_SCHEMES = ("s3://", "file://")

_MODEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$"
_REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$"


def is_upload_uri(name: str) -> bool:
    """Whether a dataset names an uploaded file rather than a built-in set."""
    return name.startswith(UPLOAD_SCHEMES)


def check_dataset(name: str) -> str:
    """A dataset is a built-in name or the URI of a file uploaded with POST /v1/uploads."""
    if name in DATASETS:
        return name
    if is_upload_uri(name) and len(name) <= 1024 and not any(c.isspace() for c in name):
        return name
    raise ValueError(
        f"dataset must be one of {', '.join(DATASETS)} or the uri returned by POST /v1/uploads; got {name!r}"
    )


DatasetName = Annotated[str, AfterValidator(check_dataset)]
KeepRatio = Annotated[
    float,
    AfterValidator(validate_ratio),
    Field(json_schema_extra={"exclusiveMinimum": 0, "maximum": 1}),  # documented; checked by validate_ratio
]


class _Strict(BaseModel):
    """Unknown fields are rejected, so a typo ('ratoi') is a 422 instead of a silently ignored option."""

    model_config = ConfigDict(extra="forbid")


class Calibration(_Strict):
    dataset: DatasetName = Field("wikitext2", description="A built-in dataset name or an upload URI.")
    samples: int = Field(64, ge=1, le=4096, description="Calibration sequences.")
    seq_len: int = Field(512, ge=16, le=16384, description="Tokens per calibration sequence.")
    seed: int = Field(0, ge=0, le=2**31 - 1)


class Evaluation(_Strict):
    datasets: list[DatasetName] = Field(default_factory=lambda: ["wikitext2"], max_length=8)
    seq_len: int = Field(512, ge=16, le=16384)
    max_windows: int | None = Field(None, ge=1, le=100_000, description="Cap on evaluation windows.")
    # Left out of stored requests when false, so requests (and their idempotency digests) read as before.
    dense_reference: bool = Field(
        False,
        exclude_if=lambda value: not value,
        description="Also evaluate the uncompressed model on the same datasets; metrics.json then carries "
        "dense_perplexity. Sweeps set it on one job set per model, for the 'ratio to dense' column.",
    )
    # Left out of stored requests when unset, like dense_reference.
    tasks: list[str] = Field(
        default_factory=list,
        max_length=len(TASKS) + 1,
        exclude_if=lambda value: not value,
        description=f"Downstream tasks scored with lm-eval: {', '.join(TASKS)}, or avg6 for the paper's six; "
        "metrics.json then carries downstream accuracy.",
    )
    limit: int | None = Field(
        None, ge=1, le=100_000, strict=True, exclude_if=lambda value: value is None,
        description="Score the first N documents of each task (default: all).",
    )

    @field_validator("datasets")
    @classmethod
    def _each_once(cls, names: list[str]) -> list[str]:
        return list(dict.fromkeys(names))

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, names: list[str]) -> list[str]:
        return list(parse_tasks(names))


class JobRequest(_Strict):
    """One compression job, or with `ratios` a set of linked jobs that differ only in keep ratio."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str = Field(..., pattern=_MODEL_PATTERN, description="A model alias (smollm2-135m) or a hub id (org/name).")
    revision: str | None = Field(None, pattern=_REVISION_PATTERN)
    method: Literal[METHODS] = "ftc"  # type: ignore[valid-type]
    ablate: list[str] = Field(default_factory=list, description="FTC components to remove (ablations).")
    ratio: KeepRatio | None = Field(None, description="Keep ratio rho in (0, 1].")
    ratios: list[KeepRatio] | None = Field(None, min_length=1, max_length=MAX_RATIOS)
    calibration: Calibration = Field(default_factory=Calibration)
    evaluation: Evaluation = Field(default_factory=Evaluation, alias="eval")
    priority: Priority = "normal"

    @field_validator("ablate", mode="before")
    @classmethod
    def _known_ablations(cls, value: Any) -> list[str]:
        if value is None or isinstance(value, str):
            return list(parse_ablations(value))
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            return list(parse_ablations(value))
        raise ValueError("ablate must be a list of names or a comma-separated string")

    @field_validator("ratios")
    @classmethod
    def _each_ratio_once(cls, values: list[float] | None) -> list[float] | None:
        return None if values is None else list(dict.fromkeys(values))

    @model_validator(mode="after")
    def _one_way_to_give_ratios(self) -> JobRequest:
        if (self.ratio is None) == (self.ratios is None):
            raise ValueError("give exactly one of ratio (a number) or ratios (a list)")
        if self.ablate and self.method != "ftc":
            raise ValueError(f"ablate removes FTC components; it needs method 'ftc', not {self.method!r}")
        return self

    def keep_ratios(self) -> list[float]:
        """The keep ratios this request asks for, one job each."""
        return [self.ratio] if self.ratio is not None else list(self.ratios or [])

    def for_ratio(self, ratio: float) -> JobRequest:
        """The single-ratio request one job of a linked set runs."""
        return self.model_copy(update={"ratio": ratio, "ratios": None})

    def datasets(self) -> list[str]:
        """Every dataset the job reads: calibration first, then evaluation."""
        return list(dict.fromkeys([self.calibration.dataset, *self.evaluation.datasets]))


class Progress(BaseModel):
    """Where a job is: `layer` of `layers` finished during `stage`, with an estimate of what is left."""

    layer: int = Field(0, ge=0)
    layers: int = Field(0, ge=0, description="0 until the worker has opened the model.")
    stage: str = Field("queued", max_length=64)
    eta_seconds: float | None = Field(None, ge=0)
    elapsed_seconds: float | None = Field(None, ge=0)


class JobRecord(BaseModel):
    """A job as stored and served: its request, where it stands, and how it got there."""

    model_config = ConfigDict(populate_by_name=True)

    id: str
    team: str
    status: JobStatus
    priority: Priority
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    progress: Progress = Field(default_factory=Progress)
    error: str | None = None
    error_kind: str | None = Field(
        None, description="Why a failed job failed: invalid_input, out_of_memory, store_unavailable, worker_lost "
        "or error (docs/workers.md, retry policy)."
    )
    cancel_requested: bool = False
    worker: str | None = None
    linked: list[str] = Field(default_factory=list, description="Jobs submitted together (one per ratio).")
    request: JobRequest


class JobPage(BaseModel):
    jobs: list[JobRecord]
    next_cursor: str | None = Field(None, description="Pass as `cursor` for the next, older page.")


class JobEvent(BaseModel):
    """One entry of a job's event stream; `id` is what SSE clients send back as Last-Event-ID."""

    id: str
    type: Literal["status", "progress", "cancel_requested"]
    data: dict[str, Any]


class Artifact(BaseModel):
    name: str = Field(..., description="Path under the job's folder, e.g. checkpoints/layer-003.safetensors.")
    size: int
    modified: datetime
    url: str = Field(..., description="A presigned URL (S3) or an API path that streams the file.")


class ArtifactList(BaseModel):
    job_id: str
    complete: bool = Field(..., description="True once manifest.json, written last, is there.")
    artifacts: list[Artifact]


class Upload(BaseModel):
    uri: str = Field(..., description="Use as calibration.dataset or in eval.datasets.")
    filename: str
    size: int
    sha256: str

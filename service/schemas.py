"""What goes over the wire: job requests, job records, progress, events, artifacts and uploads.

Validation lives here so the API answers bad input with a 422 that names the field, and so the
workers can trust every stored request. Names come from `ftc.options`, shared with the library.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ftc.evaluation.tasks import TASKS, parse_tasks
from ftc.models.hub import parse_hub_id
from ftc.options import (
    ABLATIONS,
    ALLOCATION_METHODS,
    ALLOCATIONS,
    DATASETS,
    DEFAULT_ALLOCATION,
    DTYPES,
    METHODS,
    MODEL_ALIASES,
    SCOPES,
    default_allocation,
    method_ratio_problem,
    parse_ablations,
    scope_problem,
    validate_ratio,
)

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JOB_STATUSES: tuple[str, ...] = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[str, ...] = ("high", "normal", "low")
"""Highest first: the order in which workers look for work."""

MAX_RATIOS = 32
UPLOAD_SCHEME = "upload://"
"""How POST /v1/uploads names a file (`upload://{upload_id}/{filename}`, read against the job's team)."""
UPLOAD_SCHEMES = (UPLOAD_SCHEME, "s3://", "file://")
"""Upload names a job may give; store URIs (s3://, file://) are what answers carried before."""

_REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$"


@dataclass(frozen=True)
class AttentionShape:
    """What submit-time checks need to know of a model: its hidden size and attention heads."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def qkv_params(self) -> int:
        """Weights of one layer's Q, K and V projections: what the keep ratio is a share of."""
        return self.hidden * self.head_dim * (self.heads + 2 * self.kv_heads)


KNOWN_SHAPES: dict[str, AttentionShape] = {"smollm2-135m": AttentionShape(hidden=576, heads=9, kv_heads=3, head_dim=64)}
"""The built-in aliases' shapes (their config.json), so the API can check a request without the model."""
LARGEST_SHAPE = AttentionShape(hidden=65536, heads=512, kv_heads=512, head_dim=128)
"""Larger than any attention layer in use (the largest hidden sizes are below 32k): a keep ratio whose
budget rounds to zero even here rounds to zero for every model."""


def check_model(name: str) -> str:
    """A model is a built-in alias or a hub id `org/name[@revision]`, exactly what a worker opens
    (`workers.inputs.model_spec`: a folder of that name under its FTC_MODELS_DIR first, then the
    Hugging Face cache or hub). Anything else, paths included, is refused here rather than by a
    worker after the job has queued; `ftc.models.hub` holds the one rule of what a hub id is."""
    if name in MODEL_ALIASES or parse_hub_id(name) is not None:
        return name
    shown = name if len(name) <= 100 else name[:100] + "..."
    raise ValueError(
        f"model {shown!r} is neither a built-in alias ({', '.join(MODEL_ALIASES)}) nor a hub id such as "
        "HuggingFaceTB/SmolLM2-135M (optionally @revision; a folder of that name under the workers' "
        "FTC_MODELS_DIR is used first); paths are not accepted"
    )


def budget_problem(model: str, ratio: float) -> str | None:
    """Why keep ratio `ratio` leaves `model` no budget at all (int(ratio x Q/K/V weights) is 0), else None."""
    shape = KNOWN_SHAPES.get(model, LARGEST_SHAPE)
    if int(ratio * shape.qkv_params) >= 1:
        return None
    smallest = 1 / shape.qkv_params
    whose = f"{model}'s {shape.qkv_params} Q/K/V weights per layer" if model in KNOWN_SHAPES else "any model"
    return f"ratio {ratio:g} keeps less than one of {whose}; use a ratio of at least {smallest:.3g}"


def calibration_problem(model: str, samples: int, seq_len: int) -> str | None:
    """Why `samples x seq_len` tokens cannot calibrate `model`, else None: fewer tokens than its hidden
    size leave the activation covariance singular, so the whitened metric is not defined."""
    shape = KNOWN_SHAPES.get(model)
    if shape is None or samples * seq_len >= shape.hidden:
        return None
    return (
        f"{samples} x {seq_len} = {samples * seq_len} calibration tokens are fewer than {model}'s hidden size "
        f"{shape.hidden}; raise samples or seq_len"
    )


def calibration_limit_problems(calibration: Calibration, max_tokens: int, loc: tuple[str, ...]) -> list[dict]:
    """Validation errors (FastAPI's shape) when `samples x seq_len` is over the deployment's limit.

    A limit of the deployment (FTC_MAX_CALIB_TOKENS, sized for a worker's memory), so the routes
    check it rather than the request model."""
    samples, seq_len = calibration.samples, calibration.seq_len
    if samples * seq_len <= max_tokens:
        return []
    message = (
        f"samples x seq_len = {samples} x {seq_len} = {samples * seq_len} calibration tokens; this service "
        f"takes at most {max_tokens} (FTC_MAX_CALIB_TOKENS): lower samples or seq_len"
    )
    return [{"loc": (*loc, "samples"), "msg": message, "type": "value_error"}]


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
    Strict(),  # `true` or "0.5" is a mistake, not 1.0 or 0.5; a whole number such as 1 is still a number
    AfterValidator(validate_ratio),
    Field(json_schema_extra={"exclusiveMinimum": 0, "maximum": 1}),  # documented; checked by validate_ratio
]


class _Strict(BaseModel):
    """Unknown fields are rejected, so a typo ('ratoi') is a 422 instead of a silently ignored option."""

    model_config = ConfigDict(extra="forbid")


STORED: dict[str, bool] = {"stored": True}
"""Validation context of a request read back from Redis (`JobRequest.from_stored`, `SweepRequest.from_stored`)."""


def stored_before_allocation(data: Any, info: ValidationInfo) -> Any:
    """A stored request as it was meant when stored: requests kept before `allocation` was written out
    left it out when it was 'uniform', the only default there was. Read them so, not as today's
    default (a new request names its allocation once resolved)."""
    if info.context == STORED and isinstance(data, dict):
        return {"allocation": "uniform", **data}
    return data


def allocation_default_text() -> str:
    """What an absent `allocation` resolves to, in words, read from `ftc.options` (never a copy of it)."""
    takers = ALLOCATION_METHODS.get(DEFAULT_ALLOCATION)
    if takers is None:
        return f"{DEFAULT_ALLOCATION!r} for every method"
    return f"{DEFAULT_ALLOCATION!r} for method {' and '.join(map(repr, takers))}, 'uniform' for the others"


def defaulted_hint(method: str, allocation: str) -> str:
    """What to add to a problem of an allocation the request did not name: it was the method's default."""
    return f"; or pass allocation 'uniform' (method {method!r} defaults to {allocation!r})"


ALLOCATION_KINDS = (
    "How rho is spent: 'uniform', the same keep ratio in every layer (the paper); 'global', one budget for the "
    "whole attention stack split by measured error curves (method 'ftc'; ftc-method.md §13); 'sensitivity', "
    "budgets from the divergence each layer's units cause compressed alone, measured once per model, "
    "calibration, method and scope and shared by the workers (GET /v1/plans; methods 'ftc' and 'cp'; §15)."
)
SCOPE_HELP = (
    "What rho is the keep ratio of: 'attention', the Q, K, V and O projections of every decoder layer (the "
    "paper's); 'model', all seven linear projections (the MLP's gate, up and down too: the whole-model ratio "
    "the SVD papers quote as 1 - rho). ftc-method.md §1, §17."
)


class Calibration(_Strict):
    dataset: DatasetName = Field("wikitext2", description="A built-in dataset name or an upload URI.")
    # 32, as `ftc compress` (ftc.compression.compress.CompressOptions.calib_samples): one default everywhere
    samples: int = Field(32, ge=1, le=4096, strict=True, description="Calibration sequences.")
    seq_len: int = Field(512, ge=16, le=16384, strict=True, description="Tokens per calibration sequence.")
    seed: int = Field(0, ge=0, le=2**31 - 1, strict=True, description="Seed of the calibration windows' offsets.")


class Evaluation(_Strict):
    datasets: list[DatasetName] = Field(
        ["wikitext2"], max_length=8,
        description="Datasets to measure perplexity on: built-in names or upload URIs; empty for none.",
    )
    seq_len: int = Field(512, ge=16, le=16384, strict=True, description="Tokens per evaluation window.")
    max_windows: int | None = Field(None, ge=1, le=100_000, strict=True, description="Cap on evaluation windows.")
    # Left out of stored requests when false, so requests (and their idempotency digests) read as before.
    dense_reference: bool = Field(
        False,
        strict=True,
        exclude_if=lambda value: not value,
        description="Also evaluate the uncompressed model on the same datasets; metrics.json then carries "
        "dense_perplexity. Sweeps set it on one job set per model, for the 'ratio to dense' column.",
    )
    # Left out of stored requests when unset, like dense_reference.
    tasks: list[str] = Field(
        [],
        max_length=len(TASKS) + 1,
        exclude_if=lambda value: not value,
        description=f"Downstream tasks scored with lm-eval: {', '.join(TASKS)}, or a group: avg5 (arc_easy, "
        "arc_challenge, hellaswag, piqa, mathqa: the headline) or avg6 (those and boolq, the paper's six); "
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

    @model_validator(mode="after")
    def _limit_needs_tasks(self) -> Evaluation:
        # a limit alone would be stored and silently ignored: the job would score no task at all
        if self.limit is not None and not self.tasks:
            raise ValueError('limit counts task documents: add tasks (e.g. ["avg6"]) or drop limit')
        return self


class JobRequest(_Strict):
    """One compression job, or with `ratios` a set of linked jobs that differ only in keep ratio."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: Annotated[str, AfterValidator(check_model)] = Field(
        ...,
        max_length=300,
        description="A model alias (smollm2-135m) or a hub id org/name, optionally org/name@revision.",
    )
    revision: str | None = Field(
        None, pattern=_REVISION_PATTERN, description="A branch, tag or commit of a hub model (or write model@revision)."
    )
    method: Literal[METHODS] = Field(  # type: ignore[valid-type]
        "ftc", description="FTC or a baseline (ftc-method.md §11)."
    )
    ablate: list[str] = Field([], description=f"FTC components to remove (ablations): {', '.join(ABLATIONS)}.")
    # Stored resolved: the record says what runs, and a later change of the default leaves queued jobs alone.
    allocation: Literal[ALLOCATIONS] = Field(  # type: ignore[valid-type]
        None,
        validate_default=True,
        description=f"{ALLOCATION_KINDS} (default: the method's, ftc.options.default_allocation: "
        f"{allocation_default_text()}; the job record holds the value it resolved to)",
    )
    # Left out of stored requests when it is the default, so requests stored before it existed stay equal.
    scope: Literal[SCOPES] = Field(  # type: ignore[valid-type]
        "attention",
        validate_default=True,  # the default must fit the ablations too (the MLP's need 'model')
        exclude_if=lambda value: value == "attention",
        description=SCOPE_HELP,
    )
    # Left out of stored requests when it is the default, like scope.
    dtype: Literal[DTYPES] = Field(  # type: ignore[valid-type]
        "float16",
        exclude_if=lambda value: value == "float16",
        description="Storage dtype of the compressed factors: the budget counts values, the artifact's bytes "
        "follow from this.",
    )
    ratio: KeepRatio | None = Field(None, description="Keep ratio rho in (0, 1].")
    ratios: list[KeepRatio] | None = Field(
        None, min_length=1, max_length=MAX_RATIOS, description="Instead of ratio: several, one linked job each."
    )
    calibration: Calibration = Field(default_factory=Calibration)
    evaluation: Evaluation = Field(default_factory=Evaluation, alias="eval")
    # Left out of stored requests when it is the default, like eval.dense_reference.
    outputs: list[Literal["compressed", "dense"]] = Field(
        ["compressed"],
        min_length=1,
        max_length=4,
        exclude_if=lambda value: value == ["compressed"],
        description="What the job publishes: 'compressed' (always: the artifact, loadable with "
        "trust_remote_code=True) and optionally 'dense', a stock checkpoint of the base architecture "
        "under dense/ (no custom code needed, no savings at inference).",
    )
    priority: Priority = Field("normal", description="Queue priority: workers take higher priorities first.")

    @field_validator("ablate", mode="before")
    @classmethod
    def _known_ablations(cls, value: Any) -> list[str]:
        if value is None or isinstance(value, str):
            return list(parse_ablations(value))
        if isinstance(value, list) and all(isinstance(name, str) for name in value):
            return list(parse_ablations(value))
        raise ValueError("ablate must be a list of names or a comma-separated string")

    _stored = model_validator(mode="before")(stored_before_allocation)

    @classmethod
    def from_stored(cls, text: str) -> JobRequest:
        """A request as the job store keeps it (JSON), read as it was meant when it was stored."""
        return cls.model_validate_json(text, context=STORED)

    @field_validator("allocation", mode="before")
    @classmethod
    def _method_default(cls, value: Any, info: ValidationInfo) -> Any:
        """Absent (or null): the method's default, through the one function that decides it."""
        if value is not None:
            return value
        method = info.data.get("method")
        return default_allocation(method) if method is not None else "uniform"  # a bad method has its own error

    @field_validator("scope")
    @classmethod
    def _scope_fits(cls, value: str, info: ValidationInfo) -> str:
        method, allocation = info.data.get("method"), info.data.get("allocation")
        if method is not None and allocation is not None:
            if problem := scope_problem(method, allocation, info.data.get("ablate") or [], value):
                raise ValueError(problem)
        return value

    @field_validator("revision")
    @classmethod
    def _revision_of_a_hub_model(cls, value: str | None, info: ValidationInfo) -> str | None:
        model = info.data.get("model")
        if value is None or model is None:
            return value
        if model in MODEL_ALIASES:
            raise ValueError(f"model {model!r} is a built-in alias and has no revisions; leave revision out")
        if "@" in model:
            raise ValueError(f"model {model!r} already names a revision; give it once, in model or in revision")
        if parse_hub_id(f"{model}@{value}") is None:
            raise ValueError(f"revision {value!r} is not a branch, tag or commit name (no '..')")
        return value

    @field_validator("outputs")
    @classmethod
    def _compressed_always(cls, value: list[str]) -> list[str]:
        if "compressed" not in value:
            raise ValueError("outputs must include 'compressed' (the artifact every job publishes); "
                             "add 'dense' beside it for a stock checkpoint")
        return list(dict.fromkeys(value))

    @field_validator("ratios")
    @classmethod
    def _each_ratio_once(cls, values: list[float] | None) -> list[float] | None:
        return None if values is None else list(dict.fromkeys(values))

    @field_validator("ratio", "ratios")
    @classmethod
    def _some_budget(cls, value: float | list[float] | None, info: ValidationInfo) -> float | list[float] | None:
        model = info.data.get("model")
        for ratio in [] if value is None or model is None else value if isinstance(value, list) else [value]:
            if problem := budget_problem(model, ratio):
                raise ValueError(problem)
        return value

    @field_validator("calibration")
    @classmethod
    def _enough_tokens(cls, value: Calibration, info: ValidationInfo) -> Calibration:
        model = info.data.get("model")
        if model is not None and (problem := calibration_problem(model, value.samples, value.seq_len)):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _one_way_to_give_ratios(self) -> JobRequest:
        if (self.ratio is None) == (self.ratios is None):
            raise ValueError("give exactly one of ratio (a number) or ratios (a list)")
        if self.ablate and self.method != "ftc":
            raise ValueError(f"ablate removes FTC components; it needs method 'ftc', not {self.method!r}")
        for ratio in self.keep_ratios():
            if problem := method_ratio_problem(self.method, ratio, self.allocation):
                if "allocation" not in self.model_fields_set:  # the default chose it: say how to choose another
                    problem += defaulted_hint(self.method, self.allocation)
                raise ValueError(problem)
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


ArtifactKind = Literal["model", "dense", "record", "checkpoint"]


class Artifact(BaseModel):
    name: str = Field(..., description="Path under the job's folder, e.g. model.safetensors or dense/config.json.")
    kind: ArtifactKind = Field(
        ..., description="model: a file of the compressed model folder (what loads); dense: of its dense export "
        "(dense/); record: metrics.json or log.txt; checkpoint: a per-layer checkpoint (checkpoints/), for resuming."
    )
    size: int
    modified: datetime
    url: str = Field(..., description="A presigned URL (S3) or an API path that streams the file.")


class CheckpointSummary(BaseModel):
    files: int = Field(..., description="Checkpoint files in the store (deleted FTC_KEEP_CHECKPOINTS after success).")
    bytes: int


class ArtifactList(BaseModel):
    job_id: str
    complete: bool = Field(..., description="True once manifest.json, written last, is there.")
    artifacts: list[Artifact] = Field(
        ..., description="Outputs first (model, dense, record); checkpoints only with ?include=checkpoints."
    )
    checkpoints: CheckpointSummary


class Upload(BaseModel):
    uri: str = Field(..., description="Use as calibration.dataset or in eval.datasets.")
    filename: str
    size: int
    sha256: str

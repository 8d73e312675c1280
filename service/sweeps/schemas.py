"""What goes over the wire for sweeps: the campaign request, its runs and their cells.

A sweep is a campaign: models x keep ratios x methods (x FTC ablations), run once or on a cron
schedule. Each run expands into ordinary jobs; the records here say which job is which cell and
how far the run has got. Field rules reuse the job request's, so a sweep accepts exactly what its
jobs would.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ftc.options import (
    ALLOCATION_METHODS,
    ALLOCATIONS,
    METHODS,
    SCOPES,
    default_allocation,
    method_ratio_problem,
    parse_ablations,
    scope_problem,
)
from service.schemas import (
    ALLOCATION_KINDS,
    SCOPE_HELP,
    STORED,
    Calibration,
    Evaluation,
    JobRequest,
    JobStatus,
    KeepRatio,
    Priority,
    Progress,
    budget_problem,
    calibration_problem,
    defaulted_hint,
    stored_before_allocation,
)
from service.sweeps.cron import check_schedule, check_timezone

MAX_MODELS = 16
MAX_RATIOS = 32
MAX_ABLATION_SETS = 8
MAX_CELLS = 512
"""Jobs one run may make: enough for a large campaign, small enough that a typo cannot flood the queue."""

RunStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
SweepStatus = Literal["scheduled", "queued", "running", "succeeded", "failed", "cancelled"]
Trigger = Literal["create", "schedule", "manual"]


def check_model_name(name: str) -> str:
    """A model is accepted when a job for it would be: the job request's own rule, not a copy of it."""
    try:
        JobRequest.model_validate({"model": name, "ratio": 1.0})
    except ValidationError as error:
        raise ValueError(str(error.errors()[0]["msg"]).removeprefix("Value error, ")) from None
    return name


def _ablation_set(value: Any) -> list[str]:
    if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return list(parse_ablations(value))
    raise ValueError("each ablation set is a list of names or a comma-separated string")


ModelName = Annotated[str, AfterValidator(check_model_name)]
AblationSet = Annotated[list[str], Field(max_length=7)]


def allocation_of(allocation: str, method: str) -> str:
    """The allocation `method`'s jobs run: the sweep's where the method takes it, else 'uniform', as
    `ftc.options.default_allocation` gives the default: one campaign compares FTC's allocation with
    baselines that have none."""
    takers = ALLOCATION_METHODS.get(allocation)
    return allocation if takers is None or method in takers else "uniform"


def default_sweep_allocation(methods: list[str]) -> str:
    """The one allocation that gives every method of the sweep its own default (`default_allocation`)
    through `allocation_of`: the default of the methods that have one other than 'uniform'."""
    defaults = {method: default_allocation(method) for method in methods}
    chosen = sorted(set(defaults.values()) - {"uniform"})
    allocation = chosen[0] if chosen else "uniform"
    if any(allocation_of(allocation, method) != default for method, default in defaults.items()):
        shown = ", ".join(f"{method}: {default}" for method, default in defaults.items())
        raise ValueError(f"no one allocation gives each method its default ({shown}); name allocation")
    return allocation


class SweepRequest(BaseModel):
    """A campaign: every model x method (x ablation set for FTC) x keep ratio becomes one job per run."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = Field(None, min_length=1, max_length=100, description="A label for people, e.g. 'nightly'.")
    models: list[ModelName] = Field(
        ..., min_length=1, max_length=MAX_MODELS, description="Model aliases or hub ids, as in a job request."
    )
    ratios: list[KeepRatio] = Field(..., min_length=1, max_length=MAX_RATIOS, description="Keep ratios rho in (0, 1].")
    methods: list[Literal[METHODS]] = Field(  # type: ignore[valid-type]
        ["ftc"], min_length=1, max_length=len(METHODS), description="Methods, each one line of the table."
    )
    ablations: list[AblationSet] = Field(
        [[]],
        min_length=1,
        max_length=MAX_ABLATION_SETS,
        description="FTC variants: each set of removed components is one more FTC line; [] is plain FTC.",
    )
    # Stored resolved, so a campaign keeps its allocation when the library's default changes.
    allocation: Literal[ALLOCATIONS] = Field(  # type: ignore[valid-type]
        None,
        validate_default=True,
        description=f"{ALLOCATION_KINDS} It applies to the methods that take it; the others run 'uniform' "
        "(default: each method's own, ftc.options.default_allocation; the sweep holds the value it resolved to)",
    )
    # Left out of stored requests when it is the default, as in a job request.
    scope: Literal[SCOPES] = Field(  # type: ignore[valid-type]
        "attention", validate_default=True, exclude_if=lambda value: value == "attention", description=SCOPE_HELP
    )
    calibration: Calibration = Field(default_factory=Calibration)
    evaluation: Evaluation = Field(default_factory=Evaluation, alias="eval")
    schedule: str | None = Field(
        None,
        max_length=100,
        description="A five-field cron expression (or @daily, @hourly, ...); runs fire at those times.",
    )
    timezone: str = Field("UTC", max_length=64, description="IANA time zone the schedule is read in.")
    priority: Priority = Field("normal", description="Queue priority of every job of the sweep.")
    change_threshold: float = Field(
        0.02,
        gt=0,
        le=10,
        strict=True,
        description="Relative perplexity change that counts as better or worse between runs.",
    )

    @field_validator("models", "methods", "ratios")
    @classmethod
    def _each_once(cls, values: list) -> list:
        return list(dict.fromkeys(values))

    @field_validator("ratios")
    @classmethod
    def _some_budget_for_every_model(cls, ratios: list[float], info: ValidationInfo) -> list[float]:
        for model in info.data.get("models") or []:
            for ratio in ratios:
                if problem := budget_problem(model, ratio):
                    raise ValueError(problem)
        return ratios

    _stored = model_validator(mode="before")(stored_before_allocation)

    @classmethod
    def from_stored(cls, text: str) -> SweepRequest:
        """A campaign as the sweep store keeps it (JSON), read as it was meant when it was stored."""
        return cls.model_validate_json(text, context=STORED)

    @field_validator("allocation", mode="before")
    @classmethod
    def _methods_default(cls, value: Any, info: ValidationInfo) -> Any:
        methods = info.data.get("methods")
        if value is not None or methods is None:  # bad methods have their own error
            return "uniform" if value is None else value
        return default_sweep_allocation(methods)

    @field_validator("allocation")
    @classmethod
    def _some_method_takes_it(cls, value: str, info: ValidationInfo) -> str:
        takers = ALLOCATION_METHODS.get(value)
        methods = info.data.get("methods") or []
        if takers is not None and methods and not set(methods) & set(takers):
            raise ValueError(f"allocation {value!r} applies to method {' or '.join(map(repr, takers))} only, which "
                             "methods does not list; add it or leave allocation out")
        return value

    @field_validator("scope")
    @classmethod
    def _scope_fits_every_line(cls, value: str, info: ValidationInfo) -> str:
        allocation = info.data.get("allocation")
        sets = [tuple(s) for s in info.data.get("ablations") or [[]]]
        for method in info.data.get("methods") or [] if allocation is not None else []:
            for ablate in sets if method == "ftc" else [()]:
                if problem := scope_problem(method, allocation_of(allocation, method), ablate, value):
                    raise ValueError(problem)
        return value

    @field_validator("calibration")
    @classmethod
    def _enough_tokens_for_every_model(cls, value: Calibration, info: ValidationInfo) -> Calibration:
        for model in info.data.get("models") or []:
            if problem := calibration_problem(model, value.samples, value.seq_len):
                raise ValueError(problem)
        return value

    @field_validator("ablations", mode="before")
    @classmethod
    def _known_ablations(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        sets = [_ablation_set(item) for item in value]
        return [list(s) for s in dict.fromkeys(tuple(s) for s in sets)]

    @field_validator("schedule")
    @classmethod
    def _valid_schedule(cls, value: str | None) -> str | None:
        return None if value is None else check_schedule(value)

    @field_validator("timezone")
    @classmethod
    def _valid_timezone(cls, value: str) -> str:
        return check_timezone(value)

    @model_validator(mode="after")
    def _bounded(self) -> SweepRequest:
        if any(self.ablations) and "ftc" not in self.methods:
            raise ValueError("ablations remove FTC components; add 'ftc' to methods or drop the ablations")
        if self.evaluation.dense_reference:
            raise ValueError("eval.dense_reference is set by the sweep itself (once per model); leave it out")
        for method in self.methods:
            for ratio in self.ratios:
                if problem := method_ratio_problem(method, ratio, self.allocation_for(method)):
                    if "allocation" not in self.model_fields_set:  # the default chose it: say how to choose another
                        problem += defaulted_hint(method, self.allocation_for(method))
                    raise ValueError(problem)
        cells = self.cell_count()
        if cells > MAX_CELLS:
            raise ValueError(
                f"this sweep makes {cells} jobs per run, more than {MAX_CELLS}; use fewer models, ratios, "
                "methods or ablation sets"
            )
        return self

    def variants(self) -> list[tuple[str, tuple[str, ...]]]:
        """(method, ablations) pairs, in request order: each FTC ablation set, then the other methods."""
        found: list[tuple[str, tuple[str, ...]]] = []
        for method in self.methods:
            sets = [tuple(s) for s in self.ablations] if method == "ftc" else [()]
            found += [(method, s) for s in sets]
        return found

    def cell_count(self) -> int:
        return len(self.models) * len(self.variants()) * len(self.ratios)

    def allocation_for(self, method: str) -> str:
        """The allocation of `method`'s jobs (`allocation_of`)."""
        return allocation_of(self.allocation, method)


def variant_label(method: str, ablate: list[str] | tuple[str, ...]) -> str:
    """How tables and plots name a method line: `ftc`, or `ftc-no_whiten+fixed_ranks` for an ablation."""
    return f"{method}-{'+'.join(ablate)}" if ablate else method


class SweepCell(BaseModel):
    """One model x variant x ratio of a run, and the job that runs it."""

    job_id: str | None = Field(None, description="Null only while the run is being expanded into jobs.")
    model: str
    method: str
    ablate: list[str] = Field(default_factory=list)
    ratio: float
    status: JobStatus = "queued"
    progress: Progress = Field(default_factory=Progress)
    error: str | None = None
    dense_reference: bool = Field(False, description="This job also evaluates the dense model.")


class RunReport(BaseModel):
    """Where a finished run's table and plots are, and what changed since the previous run."""

    folder: str = Field(..., description="Prefix of the run's files, e.g. runs/run_01jd.../")
    files: list[str]
    previous_run: str | None = None
    better: int = 0
    worse: int = 0
    written_at: datetime


class SweepRun(BaseModel):
    """One execution of the campaign; `status` is `succeeded` once every cell has succeeded."""

    id: str
    trigger: Trigger
    slot: datetime | None = Field(None, description="The cron slot that fired it (scheduled runs).")
    created_at: datetime
    finished_at: datetime | None = None
    status: RunStatus
    counts: dict[str, int] = Field(default_factory=dict, description="Cells per job status.")
    report: RunReport | None = None


class SweepRunDetail(SweepRun):
    cells: list[SweepCell]


class SweepSummary(BaseModel):
    id: str
    team: str
    name: str | None = None
    status: SweepStatus
    created_at: datetime
    updated_at: datetime
    schedule: str | None = None
    timezone: str = "UTC"
    next_run_at: datetime | None = None
    cancelled_at: datetime | None = None
    runs_total: int = 0
    latest_run: SweepRun | None = None


class SweepRecord(SweepSummary):
    """A sweep as served by GET /v1/sweeps/{id}: the campaign, its recent runs, one run in full."""

    model_config = ConfigDict(populate_by_name=True)

    request: SweepRequest
    runs: list[SweepRun] = Field(default_factory=list, description="Most recent first.")
    run: SweepRunDetail | None = Field(None, description="The latest run (or the one asked for) with its cells.")


class SweepPage(BaseModel):
    sweeps: list[SweepSummary]
    next_cursor: str | None = None


class SweepFile(BaseModel):
    name: str = Field(..., description="Path under the sweep's folder, e.g. plot.svg or runs/run_.../results.csv.")
    size: int
    modified: datetime
    url: str = Field(..., description="The API URL that streams the file (send the API key).")


class SweepFileList(BaseModel):
    sweep_id: str
    files: list[SweepFile]

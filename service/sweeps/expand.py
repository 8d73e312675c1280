"""How one run of a campaign becomes jobs: a linked job set per model x variant, one job per ratio.

Each (model, method, ablations) line is one ordinary job request with `ratios`, so the job store
makes its jobs as one linked set, exactly as a client submitting that request would. The first
line of each model also asks for the dense model's perplexity (`eval.dense_reference`), which the
result table divides by.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from service.schemas import JobRequest
from service.sweeps.schemas import SweepRequest


@dataclass(frozen=True)
class PlannedCell:
    """A cell as stored in a run record: what it computes, which job set makes it, and its job."""

    model: str
    method: str
    ablate: tuple[str, ...]
    ratio: float
    group: int
    dense_reference: bool
    job_id: str | None = None

    def to_json(self) -> dict:
        return asdict(self) | {"ablate": list(self.ablate)}

    @classmethod
    def from_json(cls, data: dict) -> PlannedCell:
        return cls(**(data | {"ablate": tuple(data["ablate"])}))


def job_sets(request: SweepRequest) -> list[JobRequest]:
    """The job requests of one run, one per model x variant, in a stable order."""
    wants_dense = bool(request.evaluation.datasets or request.evaluation.tasks)
    sets = []
    for model in request.models:
        for index, (method, ablate) in enumerate(request.variants()):
            evaluation = request.evaluation.model_copy(update={"dense_reference": wants_dense and index == 0})
            sets.append(
                JobRequest(
                    model=model,
                    method=method,
                    ablate=list(ablate),
                    allocation=request.allocation_for(method),
                    scope=request.scope,
                    ratios=list(request.ratios),
                    calibration=request.calibration,
                    evaluation=evaluation,
                    priority=request.priority,
                )
            )
    return sets


def plan_cells(request: SweepRequest) -> list[PlannedCell]:
    """Every cell of one run, in job-set order and, within a set, in ratio order (as its jobs are made)."""
    return [
        PlannedCell(
            model=job_set.model,
            method=job_set.method,
            ablate=tuple(job_set.ablate),
            ratio=ratio,
            group=group,
            dense_reference=job_set.evaluation.dense_reference,
        )
        for group, job_set in enumerate(job_sets(request))
        for ratio in job_set.keep_ratios()
    ]


def idempotency_key(sweep_id: str, run_id: str, group: int) -> str:
    """Submitting a run's job set twice (a crash mid-expansion, two expanders) returns the same jobs."""
    return f"sweep:{sweep_id}:{run_id}:{group}"

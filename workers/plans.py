"""The service's shared layer plans (service/plans.py) as the library's `PlanStore`.

`ftc.compression.compress.compress(..., plan_store=...)` calls `curves(key, measure)` when a job's allocation
is `sensitivity`; this hands the call to `SharedPlans`, which reads the team's plan from the
object store or measures it once among every worker, and converts between the library's
`UnitCurve` and the plan's JSON entries (`dataclasses.asdict`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ftc.compression.sensitivity import PlanStore, UnitCurve
from service.plans import SharedPlans

CURVE_FIELDS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(UnitCurve))


def curves_from_json(entries: list[dict]) -> list[UnitCurve]:
    """The curves a plan's entries describe; ValueError when an entry is not one (another library
    version's plan), so it is measured again instead of deciding the budgets."""
    curves = []
    for entry in entries:
        if not isinstance(entry, dict) or sorted(entry) != sorted(CURVE_FIELDS):
            shown = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"a plan entry has {shown}, not the fields of UnitCurve {list(CURVE_FIELDS)}")
        curves.append(UnitCurve(**{name: tuple(value) if isinstance(value, list) else value
                                   for name, value in entry.items()}))
    return curves


class StorePlans(PlanStore):
    """Plans of one job, shared through the object store; `ready()` runs once a plan is in hand."""

    def __init__(self, shared: SharedPlans, ready: Callable[[], None] = lambda: None) -> None:
        self.shared = shared
        self.ready = ready
        self.keys: list[str] = []
        """The plans this job used, for its metrics."""

    def curves(self, key: str, measure: Callable[[], list[UnitCurve]]) -> list[UnitCurve]:
        curves = self.shared.get(key, lambda: [dataclasses.asdict(curve) for curve in measure()], curves_from_json)
        self.keys.append(key)
        self.ready()
        return curves

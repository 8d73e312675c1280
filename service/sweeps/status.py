"""Where a run and a campaign stand, derived from their cells' job statuses (never stored twice).

A run's status is read from its jobs while it is open, and frozen into the run record when its
report is written, so an old run keeps saying how it ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from service.schemas import TERMINAL_STATUSES


def run_status(cell_statuses: Iterable[str], cancelled: bool) -> str:
    """`succeeded` once every cell has; `failed` when all ended but some did not succeed;
    `cancelled` when the campaign was cancelled before all cells ended (or some were cancelled by it);
    otherwise `running` as soon as one cell has started, else `queued`."""
    statuses = list(cell_statuses)
    if statuses and all(s in TERMINAL_STATUSES for s in statuses):
        if all(s == "succeeded" for s in statuses):
            return "succeeded"
        return "cancelled" if cancelled and "cancelled" in statuses else "failed"
    if cancelled:
        return "cancelled"
    return "running" if any(s != "queued" for s in statuses) else "queued"


def all_ended(cell_statuses: Iterable[str]) -> bool:
    return all(s in TERMINAL_STATUSES for s in cell_statuses)


def counts(cell_statuses: Iterable[str]) -> dict[str, int]:
    return dict(sorted(Counter(cell_statuses).items()))

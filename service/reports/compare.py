"""What changed since the previous run of the same campaign: the point of running it every night.

Cells are matched by (model, method, rho) and compared per evaluation dataset. A perplexity that
moved by more than the campaign's `change_threshold` (relative) is better or worse; a cell that
gave a result last time and none now (or the reverse) is listed too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from service.reports.rows import ResultRow

CellKey = tuple[str, str, float]


@dataclass(frozen=True)
class Change:
    model: str
    method: str
    ratio: float
    dataset: str
    before: float
    after: float

    @property
    def relative(self) -> float:
        return self.after / self.before - 1.0

    def to_json(self) -> dict:
        return dict(self.__dict__) | {"relative": self.relative}


@dataclass
class Comparison:
    previous_run: str | None
    threshold: float
    better: list[Change] = field(default_factory=list)
    worse: list[Change] = field(default_factory=list)
    unchanged: int = 0
    lost: list[CellKey] = field(default_factory=list)
    """Cells with a result in the previous run and none now (failed, cancelled, or no longer asked for)."""
    gained: list[CellKey] = field(default_factory=list)
    """Cells with a result now and none in the previous run."""

    def to_json(self) -> dict:
        return {
            "previous_run": self.previous_run,
            "threshold": self.threshold,
            "better": [c.to_json() for c in self.better],
            "worse": [c.to_json() for c in self.worse],
            "unchanged": self.unchanged,
            "lost": [list(key) for key in self.lost],
            "gained": [list(key) for key in self.gained],
        }


def _measured(rows: Iterable[ResultRow]) -> dict[CellKey, dict[str, float]]:
    return {(r.model, r.method, r.ratio): r.perplexity for r in rows if r.status == "succeeded" and r.perplexity}


def compare(
    previous: Iterable[ResultRow], current: Iterable[ResultRow], threshold: float, previous_run: str | None
) -> Comparison:
    before, after = _measured(previous), _measured(current)
    result = Comparison(previous_run=previous_run, threshold=threshold)
    result.lost = sorted(set(before) - set(after))
    result.gained = sorted(set(after) - set(before))
    for key in sorted(set(before) & set(after)):
        for dataset in sorted(set(before[key]) & set(after[key])):
            change = Change(*key, dataset=dataset, before=before[key][dataset], after=after[key][dataset])
            if change.relative < -threshold:
                result.better.append(change)
            elif change.relative > threshold:
                result.worse.append(change)
            else:
                result.unchanged += 1
    # Largest change first; equal changes (to display precision) in table order.
    result.worse.sort(key=lambda c: (-round(c.relative, 6), c.model, c.method, -c.ratio, c.dataset))
    result.better.sort(key=lambda c: (round(c.relative, 6), c.model, c.method, -c.ratio, c.dataset))
    return result


def _changes_table(changes: list[Change]) -> list[str]:
    lines = ["| model | method | rho | dataset | before | now | change |", "|---|---|---|---|---|---|---|"]
    lines += [
        f"| {c.model} | {c.method} | {c.ratio:g} | {c.dataset} | {c.before:.3f} | {c.after:.3f} | {c.relative:+.1%} |"
        for c in changes
    ]
    return lines


def comparison_markdown(comparison: Comparison) -> str:
    if comparison.previous_run is None:
        return (
            "## Changes since the previous run\n\nThis is the first finished run of the campaign: nothing to compare.\n"
        )
    lines = [
        f"## Changes since run {comparison.previous_run}",
        "",
        f"Perplexity changes beyond {comparison.threshold:.1%}: {len(comparison.worse)} worse, "
        f"{len(comparison.better)} better, {comparison.unchanged} within the threshold.",
    ]
    for title, changes in (("Worse", comparison.worse), ("Better", comparison.better)):
        if changes:
            lines += ["", f"### {title}", "", *_changes_table(changes)]
    for title, keys in (("No result any more", comparison.lost), ("New results", comparison.gained)):
        if keys:
            lines += ["", f"### {title}", ""] + [f"- {model} {method} rho {ratio:g}" for model, method, ratio in keys]
    return "\n".join(lines) + "\n"

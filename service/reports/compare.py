"""What changed since the previous run of the same campaign: the point of running it every night.

Cells are matched by (model, method, rho) and compared per evaluation dataset and per downstream
task. A perplexity that moved by more than the campaign's `change_threshold` (relative), or an
accuracy that moved by more than that many points (0.02: two points), is better or worse; a cell
that gave a result last time and none now (or the reverse) is listed too.
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
    metric: str = "perplexity"
    """`perplexity` (lower is better) or `accuracy` of the task named in `dataset` (higher is better)."""

    @property
    def relative(self) -> float:
        return self.after / self.before - 1.0

    @property
    def gain(self) -> float:
        """How much better it got: the relative fall of a perplexity, the rise of an accuracy in points."""
        return self.after - self.before if self.metric == "accuracy" else -self.relative

    def to_json(self) -> dict:
        change = {"points": self.gain} if self.metric == "accuracy" else {"relative": self.relative}
        return dict(self.__dict__) | change


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


def _accuracies(rows: Iterable[ResultRow]) -> dict[CellKey, dict[str, float]]:
    return {(r.model, r.method, r.ratio): r.accuracy for r in rows if r.status == "succeeded" and r.accuracy}


def _table_order(change: Change) -> tuple:
    return change.model, change.method, -change.ratio, change.metric != "perplexity", change.dataset


def compare(
    previous: Iterable[ResultRow], current: Iterable[ResultRow], threshold: float, previous_run: str | None
) -> Comparison:
    previous, current = list(previous), list(current)
    before, after = _measured(previous), _measured(current)
    result = Comparison(previous_run=previous_run, threshold=threshold)
    cells_before, cells_after = set(before) | set(_accuracies(previous)), set(after) | set(_accuracies(current))
    result.lost = sorted(cells_before - cells_after)
    result.gained = sorted(cells_after - cells_before)
    for metric, (old, new) in (("perplexity", (before, after)),
                               ("accuracy", (_accuracies(previous), _accuracies(current)))):
        for key in sorted(set(old) & set(new)):
            for name in sorted(set(old[key]) & set(new[key])):
                change = Change(*key, dataset=name, before=old[key][name], after=new[key][name], metric=metric)
                if change.gain > threshold:
                    result.better.append(change)
                elif change.gain < -threshold:
                    result.worse.append(change)
                else:
                    result.unchanged += 1
    # Largest change first; equal changes (to display precision) in table order.
    result.worse.sort(key=lambda c: (round(c.gain, 6), *_table_order(c)))
    result.better.sort(key=lambda c: (-round(c.gain, 6), *_table_order(c)))
    return result


def _changes_table(changes: list[Change]) -> list[str]:
    lines = ["| model | method | rho | dataset | before | now | change |", "|---|---|---|---|---|---|---|"]
    for c in changes:
        if c.metric == "accuracy":
            values = f"acc {c.dataset} | {100 * c.before:.1f}% | {100 * c.after:.1f}% | {100 * c.gain:+.1f} pts"
        else:
            values = f"{c.dataset} | {c.before:.3f} | {c.after:.3f} | {c.relative:+.1%}"
        lines.append(f"| {c.model} | {c.method} | {c.ratio:g} | {values} |")
    return lines


def comparison_markdown(comparison: Comparison) -> str:
    if comparison.previous_run is None:
        return (
            "## Changes since the previous run\n\nThis is the first finished run of the campaign: nothing to compare.\n"
        )
    lines = [
        f"## Changes since run {comparison.previous_run}",
        "",
        f"Perplexity changes beyond {comparison.threshold:.1%} (accuracy: beyond {100 * comparison.threshold:.1f} "
        f"points): {len(comparison.worse)} worse, "
        f"{len(comparison.better)} better, {comparison.unchanged} within the threshold.",
    ]
    for title, changes in (("Worse", comparison.worse), ("Better", comparison.better)):
        if changes:
            lines += ["", f"### {title}", "", *_changes_table(changes)]
    for title, keys in (("No result any more", comparison.lost), ("New results", comparison.gained)):
        if keys:
            lines += ["", f"### {title}", ""] + [f"- {model} {method} rho {ratio:g}" for model, method, ratio in keys]
    return "\n".join(lines) + "\n"

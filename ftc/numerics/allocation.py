"""A model-wide budget: how much of `rho` each layer, and each part of a layer, gets.

The paper spends the same `rho` in every layer. Layers differ in how compressible they are and in
how much their error moves the model's output, so one budget for the whole attention stack, split
by measured error-versus-budget curves, does better at the same total. Each *unit* (a layer's
Q/K/V tensor, its `W_O`, or one matrix for a per-matrix method) offers candidate budgets with a
predicted error each; the allocator picks one candidate per unit, minimising the weighted sum of
errors with the total stored values at most the budget.

Pure math, no model objects: the curves come from a statistics pass (`ftc.compression.pipeline.survey_layers`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from .metric import Whitening
from .tucker import EnergyTable, allocate, hosvd, squared_norm, whiten_and_balance


@dataclass(frozen=True)
class Curve:
    """Candidate budgets of one unit: stored values (ascending) and the predicted error at each.

    `weight` converts the unit's own error (relative, in its whitened metric) into an estimate of
    its effect on the model's output, so that errors of different layers can be added.
    """

    unit: str
    costs: tuple[int, ...]
    errors: tuple[float, ...]
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.costs or len(self.costs) != len(self.errors):
            raise ValueError(f"curve {self.unit}: needs as many errors as costs, at least one")
        if any(b <= a for a, b in zip(self.costs, self.costs[1:], strict=False)):
            raise ValueError(f"curve {self.unit}: costs must be strictly increasing")
        if not all(math.isfinite(e) for e in self.errors) or not math.isfinite(self.weight):
            raise ValueError(f"curve {self.unit}: errors and weight must be finite")


def _hull(costs: tuple[int, ...], errors: list[float]) -> list[int]:
    """Indices of the lower convex hull of `(cost, error)`, cheapest first, errors falling.

    Points above the hull are never worth choosing at any price per unit of error, so the
    allocator only moves along the hull.
    """
    hull: list[int] = []
    for i in range(len(costs)):
        if hull and errors[i] >= errors[hull[-1]]:
            continue  # costs more, no better
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b is not on the lower hull if the slope a->i is at most the slope a->b
            if (errors[i] - errors[a]) * (costs[b] - costs[a]) <= (errors[b] - errors[a]) * (costs[i] - costs[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def choose(curves: list[Curve], budget: int) -> list[int]:
    """Index of the chosen candidate of each curve: least `sum weight * error` with `sum cost <= budget`.

    Every unit starts at its cheapest candidate; the upgrades along each curve's lower convex hull
    are then taken in order of error removed per stored value (the greedy solution of the
    Lagrangian relaxation, exact whenever the budget lands on a hull vertex). An upgrade that no
    longer fits closes its unit; cheaper upgrades of the other units still fill the remainder.
    """
    chosen = [0] * len(curves)
    spent = sum(c.costs[0] for c in curves)
    if spent > budget:
        raise ValueError(f"budget of {budget} values is below the cheapest candidates ({spent} values)")
    hulls = [_hull(c.costs, [c.weight * e for e in c.errors]) for c in curves]
    for u, hull in enumerate(hulls):
        chosen[u] = hull[0]
        spent += curves[u].costs[hull[0]] - curves[u].costs[0]

    def step(u: int, position: int) -> tuple[float, int, int, int] | None:
        hull, curve = hulls[u], curves[u]
        if position + 1 >= len(hull):
            return None
        a, b = hull[position], hull[position + 1]
        gain = curve.weight * (curve.errors[a] - curve.errors[b]) / (curve.costs[b] - curve.costs[a])
        return (-gain, u, position + 1, curve.costs[b] - curve.costs[a])

    heap = [s for u in range(len(curves)) if (s := step(u, 0)) is not None]
    heapq.heapify(heap)
    while heap:
        _, u, position, extra = heapq.heappop(heap)
        if spent + extra > budget:
            continue  # this unit stops here; the others may still fit theirs
        spent += extra
        chosen[u] = hulls[u][position]
        if (s := step(u, position)) is not None:
            heapq.heappush(heap, s)
    return chosen


SPREAD = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
"""Multiples of the global `rho` tried as a unit's own keep ratio **[choice]**."""


def candidate_ratios(ratio: float) -> list[float]:
    """Keep ratios tried for a unit around the global `ratio`, capped at 1 (dense)."""
    return sorted({min(1.0, ratio * s) for s in SPREAD})


def lowrank_curve(unit: str, singular_values: torch.Tensor, rows: int, cols: int, ratio: float,
                  weight: float = 1.0) -> Curve:
    """Error of a rank-`r` truncation relative to the whole, at every rank up to the candidates' largest.

    `singular_values` are those of the matrix in its own (whitened) metric, so the tail energy is
    the exact truncation error (Eckart-Young). Costs are `r * (rows + cols)` stored values.
    """
    energy = singular_values.double().pow(2)
    total = float(energy.sum()) or 1.0
    tail = (total - torch.cumsum(energy, 0)) / total
    largest = min(len(energy), max(1, int(max(candidate_ratios(ratio)) * rows * cols / (rows + cols))))
    ranks = range(1, largest + 1)
    return Curve(unit, tuple(r * (rows + cols) for r in ranks), tuple(float(tail[r - 1]) for r in ranks), weight)


def tucker_curve(tensor: torch.Tensor, whitening: Whitening, budgets: list[int], balance: bool = True,
                 weights: torch.Tensor | None = None, dense_core: bool = False) -> list[float]:
    """Predicted relative error of the Q/K/V tensor at each budget, from one HOSVD (§6).

    The allocator's own prediction (HOSVD factors, top-K core) in the whitened, balanced metric
    with the compression's slice weights: the refit of §7 only lowers it, by a similar fraction at
    every budget. `dense_core`: the allocator's prediction among dense cores only.
    """
    _, d, dh = tensor.shape
    balanced, _ = whiten_and_balance(tensor, whitening, balance, weights)  # releases the factor
    total = squared_norm(balanced) or 1.0
    _, _, core = hosvd(balanced, consume=True)  # the core over the spent balanced tensor: 201 MB at 7B
    del balanced
    table = EnergyTable(core, owned=True)
    return [allocate(table, total, b, d, dh, dense_core=dense_core).predicted_error / total for b in budgets]


def heterogeneous_ratios(losses: torch.Tensor, ratio: float, floor: float = 0.01) -> list[float]:
    """SVD-LLM V2's keep ratios for a group of same-shape matrices from their truncation losses.

    The compression ratio `1 - ratio` is spread in inverse proportion to the log-normalised
    theoretical loss `log(1 + L_i)` at the uniform ratio (matrices that lose more are cut less):
    `c_i = n (1 - ratio) (1 / l_i) / sum_j (1 / l_j)`, keep `1 - c_i`. Keep ratios are clipped to
    `[floor, 1]` and the ones above the floor scaled down until the group's mean is `ratio` again,
    so the group stays within its budget. `log(1 + L)` (the paper: `log L`) keeps a loss below 1
    from turning the weight negative.
    """
    inverse = 1.0 / torch.log1p(losses.double()).clamp_min(1e-12)
    keep = (1 - len(losses) * (1 - ratio) * inverse / inverse.sum()).clamp(floor, 1.0)
    for _ in range(100):
        excess = float(keep.sum()) - ratio * len(losses)
        movable = keep > floor
        if excess <= 1e-12 or not bool(movable.any()):
            break
        share = keep[movable] - floor
        keep[movable] -= share * min(1.0, excess / float(share.sum()))
    return keep.tolist()

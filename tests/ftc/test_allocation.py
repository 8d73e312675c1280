"""The model-wide budget (ftc-method.md §13) against its definitions, and end to end on a tiny model."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ftc.compression.methods import make_method
from ftc.models.arch import layout_of
from ftc.numerics.allocation import Curve, _hull, candidate_ratios, choose, heterogeneous_ratios, lowrank_curve
from ftc.numerics.lowrank import eig_whitened_svd
from tests.support.pipeline import compress_model
from tests.support.tiny import tiny_model


def _objective(curves: list[Curve], picks) -> float:
    return sum(c.weight * c.errors[i] for c, i in zip(curves, picks, strict=True))


def _cost(curves: list[Curve], picks) -> int:
    return sum(c.costs[i] for c, i in zip(curves, picks, strict=True))


def _convex_curve(unit: str, g: torch.Generator, points: int = 6, step: int = 10) -> Curve:
    """Errors falling with ever smaller gains: a convex curve on equally spaced costs."""
    gains = torch.sort(torch.rand(points - 1, generator=g, dtype=torch.float64), descending=True).values
    errors = [1.0]
    for gain in gains.tolist():
        errors.append(errors[-1] - 0.19 * gain)
    weight = float(torch.rand(1, generator=g)) + 0.1
    return Curve(unit, tuple(step * (i + 1) for i in range(points)), tuple(errors), weight)


@pytest.mark.parametrize("seed", range(5))
def test_choose_is_optimal_on_convex_curves_with_equal_steps(seed):
    g = torch.Generator().manual_seed(seed)
    curves = [_convex_curve(f"u{i}", g) for i in range(4)]
    for budget in (40, 75, 130, 240):
        picks = choose(curves, budget)
        assert _cost(curves, picks) <= budget
        best = min(_objective(curves, p) for p in itertools.product(range(6), repeat=4)
                   if _cost(curves, p) <= budget)
        assert _objective(curves, picks) == pytest.approx(best, abs=1e-12)


def test_choose_meets_the_budget_and_beats_the_uniform_choice_on_ragged_curves():
    g = torch.Generator().manual_seed(7)
    curves = []
    for i in range(6):
        costs = torch.sort(torch.randperm(200, generator=g)[:7] + 1).values.tolist()
        errors = torch.sort(torch.rand(7, generator=g, dtype=torch.float64), descending=True).values.tolist()
        curves.append(Curve(f"u{i}", tuple(costs), tuple(errors), float(torch.rand(1, generator=g)) + 0.1))
    for position in range(7):
        uniform = [position] * len(curves)
        budget = _cost(curves, uniform)
        picks = choose(curves, budget)
        assert _cost(curves, picks) <= budget
        assert _objective(curves, picks) <= _objective(curves, uniform) + 1e-12


def test_choose_refuses_a_budget_below_the_cheapest_candidates():
    with pytest.raises(ValueError, match="below the cheapest"):
        choose([Curve("a", (10, 20), (1.0, 0.5)), Curve("b", (10,), (1.0,))], 19)


def test_hull_keeps_the_lower_convex_points_only():
    costs = (1, 2, 3, 4, 5)
    errors = [1.0, 0.9, 0.5, 0.45, 0.46]  # (2, 0.9) lies above the chord 1->3; 5 is no better than 4
    assert _hull(costs, errors) == [0, 2, 3]


def test_lowrank_curve_is_the_eckart_young_tail():
    w = torch.randn(30, 20, dtype=torch.float64)
    s = torch.linalg.svdvals(w)
    curve = lowrank_curve("o", s, 30, 20, 0.5)
    for rank in (1, 4, 9):
        u, sv, vh = torch.linalg.svd(w, full_matrices=False)
        approx = u[:, :rank] * sv[:rank] @ vh[:rank]
        assert curve.costs[rank - 1] == rank * 50
        assert curve.errors[rank - 1] == pytest.approx(float((w - approx).pow(2).sum() / w.pow(2).sum()))
    assert max(candidate_ratios(0.5)) == 1.0 and min(candidate_ratios(0.4)) == pytest.approx(0.1)


def test_global_allocation_stays_within_the_model_wide_budget():
    calib = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
    model = tiny_model("gqa", layers=3)
    layout = layout_of(model.config)
    method = make_method("ftc", 0.3, torch.float16, (), "global")
    result = compress_model(model, layout, method, calib, device=torch.device("cpu"), batch_size=4, progress=False)
    o_cost = layout.heads * layout.head_dim + layout.hidden
    spent = sum(layer.report["qkv_budget"] + layer.report["r_o"] * o_cost for layer in result.layers)
    assert spent <= 0.3 * 3 * (layout.qkv_params + layout.o_params)
    budgets = [(layer.report["qkv_budget"], layer.report["r_o"]) for layer in result.layers]
    assert len(set(budgets)) > 1, "the plan should not be uniform on layers this different"
    json.dumps(budgets)  # the plan goes into the manifest and the work-dir fingerprint
    with pytest.raises(ValueError, match="allocation"):
        make_method("svd", 0.3, torch.float16, (), "global")


def test_heterogeneous_ratios_follow_the_svd_llm_v2_formula_and_keep_the_mean():
    losses = torch.tensor([10.0, 100.0, 1000.0, 50.0], dtype=torch.float64)
    keep = torch.tensor(heterogeneous_ratios(losses, 0.6), dtype=torch.float64)
    inverse = 1 / torch.log1p(losses)
    torch.testing.assert_close(keep, 1 - 4 * 0.4 * inverse / inverse.sum())  # no clipping needed here
    assert keep[2] > keep[1] > keep[3] > keep[0]  # the larger the loss, the less it is cut
    clipped = heterogeneous_ratios(torch.tensor([1e-3, 1e6, 1e6]), 0.2)
    assert min(clipped) >= 0.01 and sum(clipped) <= 3 * 0.2 + 1e-9


def test_eig_whitened_svd_reaches_the_minimum_truncation_loss():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 16, dtype=torch.float64, generator=g) * torch.logspace(0, -3, 16, dtype=torch.float64)
    gram = x.T @ x / 500
    w = torch.randn(16, 10, dtype=torch.float64, generator=g)
    a, b = eig_whitened_svd(w, gram, 4)
    root = torch.linalg.cholesky(gram)
    tail = torch.linalg.svdvals(root.T @ w)[4:].pow(2).sum()
    torch.testing.assert_close((x @ (w - a @ b)).pow(2).sum() / 500, tail, rtol=1e-5, atol=0)


def test_svd_llm_v2_spends_at_most_rho_per_matrix_type_over_the_model():
    calib = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
    model = tiny_model("gqa", layers=3)
    layout = layout_of(model.config)
    result = compress_model(model, layout, make_method("svd_llm_v2", 0.3, torch.float16), calib,
                            device=torch.device("cpu"), batch_size=4, progress=False)
    ranks = {p: [] for p in "qkvo"}
    for layer in result.layers:
        for spec, _ in layer.groups:
            ranks[spec["proj"][0]].append(spec["rank"])
    sizes = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "o": (64, 64)}
    for proj, (rows, cols) in sizes.items():
        assert sum(r * (rows + cols) for r in ranks[proj]) <= 0.3 * 3 * rows * cols
    assert any(len(set(r)) > 1 for r in ranks.values()), "SVD-LLM V2's ratios differ across layers"

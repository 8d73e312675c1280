"""CP compression of the joint tensor against its definitions (ftc-method.md §14)."""

from __future__ import annotations

import pytest
import torch

from ftc.numerics.cp import (
    CPFactors,
    compress_cp,
    cp_als,
    cp_error,
    cp_rank,
    cp_reconstruct,
    cp_storage_values,
    hosvd_init,
)
from ftc.numerics.metric import Whitening
from ftc.numerics.tucker import hosvd
from ftc.runtime.stored import build_modules, cp_tensors

D = torch.float64


def _factors(slices: int, d: int, dh: int, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, rank, dtype=D, generator=g) for n in (d, dh, slices))


def _noisy(slices=9, d=30, dh=6, rank=10, noise=0.3, seed=0) -> torch.Tensor:
    """A CP tensor of rank > dh plus noise: no exact fit, so ALS has to work for its error."""
    a, b, c = _factors(slices, d, dh, rank, seed)
    g = torch.Generator().manual_seed(seed + 100)
    return cp_reconstruct(a, b, c) + noise * torch.randn(slices, d, dh, dtype=D, generator=g)


def test_reconstruct_and_error_match_the_definition():
    a, b, c = _factors(4, 7, 3, 5, seed=1)
    t = torch.randn(4, 7, 3, dtype=D, generator=torch.Generator().manual_seed(2))
    direct = torch.stack([sum(c[s, r] * torch.outer(a[:, r], b[:, r]) for r in range(5)) for s in range(4)])
    torch.testing.assert_close(cp_reconstruct(a, b, c), direct)
    assert cp_error(t, a, b, c) == pytest.approx(float((t - direct).pow(2).sum()), rel=1e-12)


def test_hosvd_start_keeps_the_heaviest_core_fibres():
    t = _noisy()
    a, b, c = hosvd_init(t, 14)  # more terms than dh = 6: mode-2 vectors are reused
    _, _, core = hosvd(t)
    kept = torch.topk(core.pow(2).sum(0).flatten(), 14).values.sum()
    expected = float(t.pow(2).sum() - kept)  # orthogonal terms: the error is the energy left out
    assert cp_error(t, a, b, c) == pytest.approx(expected, rel=1e-9)


def test_als_recovers_an_exact_cp_tensor_of_rank_above_dh():
    slices, d, dh, rank = 10, 20, 6, 8
    a, b, c = _factors(slices, d, dh, rank, seed=4)
    t = cp_reconstruct(a, b, c)
    fit = cp_als(t, rank, max_sweeps=400, tolerance=0.0)
    assert fit.errors[0] > 1e-2  # the start is far from it
    assert fit.errors[-1] < 1e-12
    assert (cp_reconstruct(fit.a, fit.b, fit.c) - t).norm() / t.norm() < 1e-6


@pytest.mark.parametrize("extrapolation", [None, 1 / 3])
def test_als_never_increases_the_error(extrapolation):
    t = _noisy()
    fit = cp_als(t, 10, max_sweeps=30, tolerance=0.0, extrapolation_power=extrapolation)
    steps = torch.tensor(fit.errors).diff()
    assert fit.sweeps == 30
    assert steps.max() <= 1e-12, f"error rose by {steps.max():.3e} in a sweep"
    assert fit.errors[-1] < 0.5 * fit.errors[0]
    if extrapolation is not None:
        assert fit.extrapolated > 0  # the line search did take steps
    # the recorded error is the error of the returned factors
    assert fit.errors[-1] == pytest.approx(cp_error(t, fit.a, fit.b, fit.c) / float(t.pow(2).sum()), rel=1e-9)


def test_als_stops_when_a_sweep_improves_less_than_the_tolerance():
    t = _noisy()
    fit = cp_als(t, 10, max_sweeps=500, tolerance=1e-3)
    assert fit.sweeps < 500
    last = (fit.errors[-2] - fit.errors[-1]) / fit.errors[-2]
    before = [(e0 - e1) / e0 for e0, e1 in zip(fit.errors[:-2], fit.errors[1:-1], strict=True)]
    assert last < 1e-3 and min(before) >= 1e-3


@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.9])
def test_rank_fills_the_budget(ratio):
    slices, d, dh = 15, 96, 16
    budget = int(ratio * d * dh * slices)
    rank = cp_rank(budget, d, dh, slices)
    assert cp_storage_values(d, dh, slices, rank) <= budget < cp_storage_values(d, dh, slices, rank + 1)
    assert rank > dh  # the regime that rules out orthonormal factors
    with pytest.raises(ValueError, match="rank-1"):
        cp_rank(d + dh + slices - 1, d, dh, slices)


def _gram(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * d, d, dtype=D, generator=g) * torch.logspace(0, 2, d, dtype=D)
    return x.T @ x / x.shape[0]


def test_reported_error_is_that_of_the_returned_weights_in_the_whitened_balanced_metric():
    slices, d, dh = 9, 30, 6
    t = _noisy(slices, d, dh) * torch.linspace(0.1, 10, slices, dtype=D)[:, None, None]  # unequal slices
    whitening = Whitening.from_gram(_gram(d, 5))
    budget = int(0.5 * d * dh * slices)
    factors, report = compress_cp(t, whitening, budget)
    assert factors.stored_values == cp_storage_values(d, dh, slices, report.rank) <= budget
    # the definition: sum_s ||R^T (W_s - W^_s)||^2 / ||R^T W_s||^2, over S unit slices
    r_t = whitening.chol.T
    white, approx = r_t @ t, r_t @ factors.weights()
    per_slice = (white - approx).pow(2).sum((1, 2)) / white.pow(2).sum((1, 2))
    assert report.error == pytest.approx(float(per_slice.sum() / slices), rel=1e-6)
    assert 0 < report.error < report.error_init


def test_cp_group_computes_the_slices_of_its_factors():
    slices, d, dh, rank = 4, 12, 5, 7  # two query heads, one key head, one value head
    a, b, c = (t.float() for t in _factors(slices, d, dh, rank, seed=6))
    spec = {"kind": "cp", "proj": ["q", "k", "v"], "heads": [2, 1, 1], "rank": rank}
    modules = build_modules(spec, cp_tensors(CPFactors(a, b, c), torch.float32), {}, dh, torch.float32)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(7))
    w = cp_reconstruct(a, b, c)  # (S, d, dh)
    with torch.no_grad():
        torch.testing.assert_close(modules["q"](x), x @ torch.cat([w[0], w[1]], dim=1))
        torch.testing.assert_close(modules["k"](x), x @ w[2])
        torch.testing.assert_close(modules["v"](x), x @ w[3])

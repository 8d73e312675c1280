"""`compress_tensor` reports the error of the weights it returns (ftc-method.md §3, §4, §7).

The reported figure is defined in the whitened, balanced metric: slice `s` contributes
`||R^T (W_s - W^_s)||^2 / n_s^2` with `n_s = ||R^T W_s||` (or 1 without balancing), relative to
the same sum for `W`. Measuring it from the returned factors catches a lost un-whitening of `U1`
or a lost un-balancing of the core, which an error computed inside the routine cannot see.
"""

from __future__ import annotations

import pytest
import torch

from ftc.numerics.metric import Whitening
from ftc.numerics.tucker import compress_tensor

D = torch.float64


def _problem(slices: int = 9, d: int = 48, dh: int = 8):
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(d, d, dtype=D, generator=g) * torch.logspace(0, -2, d, dtype=D)
    x = torch.randn(2000, d, dtype=D, generator=g) @ mix  # anisotropic inputs: a real whitening
    shared = torch.randn(d, 10, dtype=D, generator=g)
    heads = torch.stack([shared @ torch.randn(10, dh, dtype=D, generator=g) for _ in range(slices)])
    heads = heads + 1.0 * torch.randn(slices, d, dh, dtype=D, generator=g)
    scales = torch.logspace(-2, 1, slices, dtype=D)  # heads three decades apart in norm
    return heads * scales[:, None, None], x.T @ x / x.shape[0]


def _per_slice(tensor: torch.Tensor, approx: torch.Tensor, whitening: Whitening) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slice's squared error and squared norm in the whitened metric."""
    white = torch.stack([whitening.apply(w) for w in tensor])
    white_diff = torch.stack([whitening.apply(w) for w in tensor - approx])
    return white_diff.flatten(1).pow(2).sum(1), white.flatten(1).pow(2).sum(1)


def _measured(tensor: torch.Tensor, approx: torch.Tensor, whitening: Whitening, balance: bool,
              weights: torch.Tensor | None = None) -> float:
    err, energy = _per_slice(tensor, approx, whitening)
    weight = energy.reciprocal() if balance else torch.ones_like(energy)
    if weights is not None:
        weight = weight * weights
    return float((weight * err).sum() / (weight * energy).sum())


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("coupled", [True, False])
def test_reported_error_is_the_error_of_the_returned_weights(balance, coupled):
    tensor, gram = _problem()
    whitening = Whitening.from_gram(gram)
    assert whitening.chol is not None
    budget = int(0.3 * tensor.numel())
    factors, report = compress_tensor(tensor, whitening, budget, balance=balance, coupled=coupled)
    assert factors.stored_values <= budget
    measured = _measured(tensor, factors.weights().to(D), whitening, balance)
    assert 1e-3 < measured < 1
    assert report.error_refit == pytest.approx(measured, rel=1e-3)


@pytest.mark.parametrize("balance", [True, False])
def test_slice_weights_count_in_the_fit_and_in_the_reported_error(balance):
    """A slice weighted `w` counts as `w` copies of itself (FTC's key slices, §4): the reported error
    is the weighted one of the returned weights, and the weighted slices are fitted better than
    without weights, at the cost of the others."""
    tensor, gram = _problem()
    whitening = Whitening.from_gram(gram)
    budget = int(0.3 * tensor.numel())
    weights = torch.ones(tensor.shape[0], dtype=D)
    heavy = slice(3, 6)
    weights[heavy] = 4.0
    plain, _ = compress_tensor(tensor, whitening, budget, balance=balance)
    factors, report = compress_tensor(tensor, whitening, budget, balance=balance, weights=weights)
    assert factors.stored_values <= budget
    approx = factors.weights().to(D)
    assert report.error_refit == pytest.approx(_measured(tensor, approx, whitening, balance, weights), rel=1e-3)
    err, energy = _per_slice(tensor, approx, whitening)
    err_plain, _ = _per_slice(tensor, plain.weights().to(D), whitening)
    light = torch.ones(tensor.shape[0], dtype=torch.bool)
    light[heavy] = False
    assert (err[heavy] / energy[heavy]).sum() < 0.9 * (err_plain[heavy] / energy[heavy]).sum()
    assert (err[light] / energy[light]).sum() > (err_plain[light] / energy[light]).sum()

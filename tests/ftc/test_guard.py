"""The whitening guard reacts to the outcome of the whitened fit (ftc-method.md §3)."""

from __future__ import annotations

import math

import pytest
import torch

from ftc.compression.methods import make_method
from ftc.models.arch import layout_of
from ftc.numerics.lowrank import guarded_whitened_svd, truncated_svd, weighted_error
from ftc.numerics.metric import MAX_EPS, Whitening, guarded_fit
from tests.support.pipeline import compress_model
from tests.support.tiny import tiny_model

D = torch.float64
GRAM = torch.diag(torch.logspace(0, -3, 8, dtype=D))


def test_a_non_finite_outcome_raises_eps_until_the_fit_is_finite():
    def fit(white: Whitening) -> float:
        return math.inf if white.eps is not None and white.eps < 1e-2 else 1.0

    for reference in (2.0, math.inf):  # a non-finite fit is refused even with no usable reference
        result, white = guarded_fit(GRAM, fit, lambda r: r, lambda: reference)  # noqa: B023
        assert (result, white.eps) == (1.0, pytest.approx(1e-2))


def test_an_error_above_the_unwhitened_one_raises_eps():
    seen = []

    def fit(white: Whitening) -> float:
        seen.append(white.eps)
        return 1e-5 / white.eps if white.eps is not None else 0.5

    _, white = guarded_fit(GRAM, fit, lambda r: r, lambda: 0.05)
    assert white.eps == pytest.approx(1e-3)  # 1e-5 / 1e-4 = 0.1 > 0.05; 1e-5 / 1e-3 = 0.01 passes
    assert seen == [1e-4, pytest.approx(1e-3)]


def test_the_identity_metric_when_no_damping_gives_a_stable_outcome():
    result, white = guarded_fit(GRAM, lambda w: 9.0 if w.eps is not None else 1.0, lambda r: r, lambda: 1.0)
    assert (result, white.chol, white.eps) == (1.0, None, None)
    assert guarded_fit(None, lambda w: w.eps, lambda r: 0.0, lambda: 0.0)[1].eps is None
    assert MAX_EPS == 1.0


def test_guarded_whitened_svd_is_never_worse_than_plain_svd_on_an_indefinite_gram():
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(20, 20, dtype=D, generator=g))[0]
    eig = torch.logspace(0, -8, 20, dtype=D)
    eig[-1] = -1e-5  # rounding made the accumulated Gram slightly indefinite
    gram = q @ torch.diag(eig) @ q.T
    w = torch.randn(20, 12, dtype=D, generator=g)
    (a, b), white = guarded_whitened_svd(w, gram, 4)
    plain_a, plain_b = truncated_svd(w, 4)
    plain = weighted_error(w, plain_a @ plain_b, gram)
    got = weighted_error(w, a @ b, gram)
    assert math.isfinite(got) and got <= plain * 1.01
    assert white.eps is not None and white.eps > 1e-4  # 1e-4 * mean(diag) cannot lift -1e-5


def test_the_eps_of_every_whitened_step_is_recorded_per_layer():
    calib = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
    model = tiny_model("gqa")
    result = compress_model(model, layout_of(model.config), make_method("ftc", 0.4, torch.float32), calib,
                            device=torch.device("cpu"), batch_size=4, progress=False)
    for layer in result.layers:
        assert layer.report["eps"] is not None
        assert layer.report["eps_o"] is not None
        assert layer.report["eps_o_solve"] is not None

"""The metric and the matrix pieces against their definitions (ftc-method.md §3, §8, §11)."""

from __future__ import annotations

import weakref

import pytest
import torch

from ftc.numerics import lowrank
from ftc.numerics import metric as metric_module
from ftc.numerics.lowrank import (
    OUTPUT_EPS,
    anchored_rhs,
    budget_rank,
    calibrated_wo,
    guarded_whitened_svd,
    scaled_svd,
    truncated_svd,
    weighted_error,
    whitened_svd,
)
from ftc.numerics.metric import Moments, Whitening, damp, pivot_signs, top_eigenpairs

torch.manual_seed(0)
D = torch.float64


def _activations(n: int = 400, d: int = 24, generator: torch.Generator | None = None) -> torch.Tensor:
    mix = torch.randn(d, d, dtype=D, generator=generator) * torch.logspace(0, -2, d, dtype=D)
    return torch.randn(n, d, dtype=D, generator=generator) @ mix


def test_moments_match_direct_computation():
    x = _activations()
    m = Moments(x.shape[1], absolute=True)
    for chunk in x.split(64):
        m.update(chunk)
    torch.testing.assert_close(m.gram, x.T @ x / x.shape[0], rtol=1e-5, atol=1e-7)  # float32 products
    torch.testing.assert_close(m.abs_mean, x.abs().mean(0))


def test_the_first_position_counts_first_weight_times_in_every_sum():
    """The definition: C = sum_t w_t x_t x_t^T / sum_t w_t, w = first_weight at position 0, else 1."""
    weight, x = 7, _activations(6 * 20).reshape(6, 20, -1)
    m = Moments(x.shape[-1], absolute=True, first_weight=weight)
    for batch in x.split(4):
        m.update(batch)
    w = torch.ones(x.shape[:2], dtype=D)
    w[:, 0] = weight
    rows, w = x.reshape(-1, x.shape[-1]), w.reshape(-1, 1)
    assert m.count == int(w.sum())
    torch.testing.assert_close(m.gram, (w * rows).T @ rows / w.sum(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m.abs_mean, (w * rows.abs()).sum(0) / w.sum())


def test_whitened_error_equals_activation_weighted_error():
    x = _activations()
    n = x.shape[0]
    gram = x.T @ x / n
    white = Whitening.from_gram(gram, eps=1e-4)
    dw = torch.randn(x.shape[1], 7, dtype=D)
    damping = 1e-4 * gram.diagonal().mean()
    # ||X dW||^2 + n*eps*mean(diag C)*||dW||^2 = n ||R^T dW||^2  (the damped metric, exactly)
    lhs = (x @ dw).pow(2).sum() + n * damping * dw.pow(2).sum()
    rhs = n * white.apply(dw).pow(2).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-9, atol=0)
    torch.testing.assert_close(white.unapply(white.apply(dw)), dw)


@pytest.mark.parametrize("balance", [True, False])
def test_weighted_error_in_column_steps_is_the_definition(monkeypatch, balance):
    import ftc.numerics.lowrank

    monkeypatch.setattr(ftc.numerics.lowrank, "COLUMNS", 3)  # 7 columns: steps of 3, 3 and 1
    x = _activations()
    gram = x.T @ x / x.shape[0]
    w, approx = torch.randn(4, 24, 7, dtype=D), torch.randn(4, 24, 7, dtype=D)
    for metric in (gram, None):
        c = torch.eye(24, dtype=D) if metric is None else metric
        energy = torch.einsum("sio,ij,sjo->s", w, c, w)
        err = torch.einsum("sio,ij,sjo->s", w - approx, c, w - approx)
        weight = 1 / energy if balance else torch.ones(4, dtype=D)
        expected = float((weight * err).sum() / (weight * energy).sum())
        assert weighted_error(w, approx, metric, balance) == pytest.approx(expected, rel=1e-12)
    assert weighted_error(w[0], approx[0], gram) == pytest.approx(
        float(torch.trace((w[0] - approx[0]).T @ gram @ (w[0] - approx[0])) / torch.trace(w[0].T @ gram @ w[0])),
        rel=1e-12)
    own = torch.Generator().manual_seed(1)  # the module's random stream stays as the next tests expect
    a, b = torch.randn(24, 2, dtype=D, generator=own), torch.randn(2, 7, dtype=D, generator=own)  # factors
    assert weighted_error(w[0], (a, b), gram) == pytest.approx(weighted_error(w[0], a @ b, gram), rel=1e-12)


def test_whitening_by_columns_is_the_whole_product_in_the_work_dtype():
    """`apply_by_columns` (a block of columns at a time, from any float dtype) is `R^T W` in float64."""
    x = _activations()
    white = Whitening.from_gram(x.T @ x / x.shape[0], eps=1e-4)
    w = torch.randn(x.shape[1], 11, dtype=torch.float32)
    by_columns = white.apply_by_columns(w, block=4)
    assert by_columns.dtype == torch.float64
    torch.testing.assert_close(by_columns, white.apply(w.double()), rtol=1e-12, atol=1e-12)


def test_guard_escalates_damping_for_a_singular_gram_and_records_it():
    # an indefinite Gram (rounding can make one) needs eps * mean(diag) > 0.01: eps = 0.1
    gram = torch.diag(torch.tensor([1.0, 1.0, -0.01], dtype=D))
    white = Whitening.from_gram(gram, eps=1e-4)
    assert white.chol is not None and white.eps == pytest.approx(0.1)
    torch.testing.assert_close(white.chol @ white.chol.T, damp(gram, white.eps))
    nan = Whitening.from_gram(torch.full((4, 4), float("nan"), dtype=D))
    assert (nan.chol, nan.eps) == (None, None)


def test_truncated_svd_reaches_the_eckart_young_error():
    w = torch.randn(30, 20, dtype=D)
    s = torch.linalg.svdvals(w)
    a, b = truncated_svd(w, 6)
    torch.testing.assert_close((w - a @ b).pow(2).sum(), s[6:].pow(2).sum())


@pytest.mark.parametrize("whole", [True, False], ids=["whole-spectrum", "subset"])
@pytest.mark.parametrize("dtype", [torch.float32, D])
def test_top_eigenpairs_are_the_leading_ones_largest_first_and_leave_a_gram_not_handed_over(dtype, whole, monkeypatch):
    """Both drivers (`syevd` up to `WHOLE_SPECTRUM_WIDTH`, `syevr`'s subset wider) give the same pairs."""
    monkeypatch.setattr(metric_module, "WHOLE_SPECTRUM_WIDTH", 12 if whole else 11)
    x = torch.randn(50, 12, dtype=D)
    gram = (x.T @ x).to(dtype)
    kept = gram.clone()
    values, vectors = top_eigenpairs(gram, 5)
    every, basis = torch.linalg.eigh(gram.to(D))
    assert values.dtype == vectors.dtype == D and vectors.shape == (12, 5)
    torch.testing.assert_close(values, every.flip(0)[:5], rtol=1e-12, atol=0)
    leading = basis.flip(1)[:, :5]
    torch.testing.assert_close(vectors * pivot_signs(vectors), leading * pivot_signs(leading), rtol=0, atol=1e-10)
    assert torch.equal(gram, kept)  # not `owned`: the caller's Gram is read, never written
    assert top_eigenpairs(gram, 40)[1].shape == (12, 12)


@pytest.mark.parametrize("shape", [(30, 20), (20, 30), (24, 24)])
def test_truncated_svd_gives_the_svds_factors_with_canonical_signs(shape):
    """From the Gram's eigenvectors, on either side: `U sqrt(S)` and `sqrt(S) V^T` of LAPACK's SVD,
    each pair signed so the largest entry of its `A` column is positive."""
    w = torch.randn(*shape, dtype=D)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    scale = s[:6].sqrt() * pivot_signs(u[:, :6])
    a, b = truncated_svd(w, 6)
    torch.testing.assert_close(a, u[:, :6] * scale, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(b, scale[:, None] * vh[:6], rtol=1e-9, atol=1e-11)
    assert (a.gather(0, a.abs().argmax(0, keepdim=True)) > 0).all()


def test_truncated_svd_of_a_rank_deficient_matrix_is_finite_and_exact():
    """A rank above the matrix's: the null directions' (rounding-sized) eigenvalues add nothing."""
    w = torch.randn(20, 3, dtype=D) @ torch.randn(3, 16, dtype=D)
    for matrix in (w, w.T, torch.zeros(5, 4, dtype=D)):
        a, b = truncated_svd(matrix, 5)
        assert a.shape[1] == b.shape[0] == min(5, *matrix.shape)
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
        torch.testing.assert_close(a @ b, matrix, rtol=0, atol=1e-6)


def test_whitened_svd_minimises_the_activation_weighted_error():
    x = _activations(d=20)
    gram = x.T @ x / x.shape[0]
    w = torch.randn(20, 12, dtype=D)
    white = Whitening.from_gram(gram, eps=1e-10)
    a, b = whitened_svd(w, white, 5)
    tail = torch.linalg.svdvals(white.apply(w))[5:].pow(2).sum()
    measured = (x @ (w - a @ b)).pow(2).sum() / x.shape[0]
    torch.testing.assert_close(measured, tail, rtol=1e-6, atol=1e-12)
    plain_a, plain_b = truncated_svd(w, 5)
    assert weighted_error(w, a @ b, gram) < weighted_error(w, plain_a @ plain_b, gram)


def test_whitened_svd_frees_the_whitened_matrix_before_forming_the_factor_again(monkeypatch):
    x = _activations(d=20)
    white = Whitening.from_gram(x.T @ x / x.shape[0], eps=1e-10)
    expected = whitened_svd(torch.randn(20, 12, dtype=D, generator=torch.Generator().manual_seed(3)), white, 5)
    whitened, alive = [], []
    svd, unapply = lowrank.truncated_svd, Whitening.unapply

    def tracked_svd(m, rank):
        whitened.append(weakref.ref(m))
        return svd(m, rank)

    def tracked_unapply(self, u):
        alive.append(whitened[-1]() is not None)
        return unapply(self, u)

    monkeypatch.setattr(lowrank, "truncated_svd", tracked_svd)
    monkeypatch.setattr(Whitening, "unapply", tracked_unapply)
    a, b = whitened_svd(torch.randn(20, 12, dtype=D, generator=torch.Generator().manual_seed(3)), white, 5)
    assert alive == [False]
    assert torch.equal(a, expected[0]) and torch.equal(b, expected[1])


def test_scaled_svd_is_exact_at_full_rank_and_budget_rank_fits():
    w = torch.randn(16, 8, dtype=D)
    a, b = scaled_svd(w, torch.rand(16, dtype=D) + 0.1, 8)
    torch.testing.assert_close(a @ b, w, rtol=1e-5, atol=1e-5)  # the SVD runs in float32
    for rows, cols, rho in [(576, 576, 0.2), (576, 192, 0.4), (10, 3, 0.01)]:
        r = budget_rank(rows, cols, rho)
        assert r >= 1 and (r == 1 or r * (rows + cols) <= rho * rows * cols)


def test_calibrated_wo_solves_the_anchored_normal_equations():
    """Its own random stream. The damping (1e-12 of the mean diagonal) moves the solution by about
    1e-12 times the Gram's condition number, which a random 12 x 12 mix, squared, puts anywhere from 1e4
    to 1e9: drawn from the global stream, the draw depended on which tests ran before, and a run in
    another order drew a condition number of 3e8 (8e-5 off `W_O`). This one's is 3e5 (6e-8 off)."""
    own = torch.Generator().manual_seed(4)
    a_t = _activations(d=12, generator=own)
    a_s = a_t + 0.1 * torch.randn(a_t.shape, dtype=D, generator=own)
    w_o = torch.randn(12, 9, dtype=D, generator=own)
    n = a_t.shape[0]
    g_ss, g_tt, g_st = a_s.T @ a_s / n, a_t.T @ a_t / n, a_s.T @ a_t / n
    rhs = anchored_rhs(a_s.T @ a_t, n, g_tt, w_o.half(), anchor=0.5)  # W_O as stored: half precision
    torch.testing.assert_close(rhs, (g_st + 0.5 * g_tt) @ w_o.half().double())
    w_star, eps = calibrated_wo(g_ss + 0.5 * g_tt, rhs, w_o, eps=1e-12)
    assert eps == 1e-12
    # gradient of ||A_s W - A_t W_O||^2 + a ||A_t (W - W_O)||^2 vanishes at the solution
    grad = g_ss @ w_star - g_st @ w_o.half().double() + 0.5 * g_tt @ (w_star - w_o.half().double())
    assert grad.abs().max() < 1e-8
    same = calibrated_wo(1.5 * g_tt, anchored_rhs(a_t.T @ a_t, n, g_tt, w_o, anchor=0.5), w_o, eps=1e-12)[0]
    torch.testing.assert_close(same, w_o, rtol=1e-4, atol=1e-5)


def test_the_compressed_wo_is_the_best_of_its_rank_for_the_anchored_objective():
    """FTC's W_O minimises `||A_s W - A_t W_O||^2 + a ||A_t (W - W_O)||^2` over rank `r_o` (§8).

    The paper's metric (`wo_student_metric`, `C_s` alone) is exact only without the anchor, so it
    must do worse here; FTC's must match the optimum computed another way (up to its damping).
    """
    from ftc.compression.methods import ContextStats, make_method
    from ftc.models.arch import AttentionLayout

    m, d, n = 16, 12, 300
    a_t = _activations(n, m)
    a_s = a_t @ torch.diag(torch.logspace(-1, 1, m, dtype=D))  # the student leans on other channels
    w_o = torch.randn(m, d, dtype=D)
    layout = AttentionLayout("llama", "model.layers", d, 4, 2, 4, "q", "k", "v", "o")

    def moments(x: torch.Tensor) -> Moments:
        found = Moments(m)
        found.update(x)
        return found

    def total(w: torch.Tensor) -> float:
        return float((a_s @ w - a_t @ w_o).pow(2).sum() + 0.5 * (a_t @ (w - w_o)).pow(2).sum())

    stacked = torch.linalg.lstsq(torch.cat([a_s, 0.5**0.5 * a_t]), torch.cat([a_t @ w_o, 0.5**0.5 * a_t @ w_o]))
    floor = total(stacked.solution)  # the full-rank optimum: what no rank can remove

    def objective(w: torch.Tensor) -> float:
        return total(w) - floor

    def compressed(ablations: tuple[str, ...]) -> torch.Tensor:
        ctx = ContextStats(teacher=moments(a_t), student=moments(a_s), cross=a_s.T @ a_t)
        group, report = make_method("ftc", 0.4, torch.float64, ablations).o(w_o, ctx, layout)
        tensors = group[1]
        return tensors["A"] @ tensors["B"], report["r_o"]

    ours, rank = compressed(())
    paper, _ = compressed(("wo_student_metric",))
    assert torch.linalg.matrix_rank(ours) == rank < min(m, d)
    assert objective(ours) < objective(paper) * (1 - 1e-3)
    # the textbook optimum of the same rank, another route: eigen square root, no damping
    values, vectors = torch.linalg.eigh(a_s.T @ a_s + 0.5 * a_t.T @ a_t)
    root = vectors @ torch.diag(values.sqrt()) @ vectors.T
    u, s, vh = torch.linalg.svd(root @ stacked.solution)
    best = torch.linalg.solve(root, u[:, :rank] * s[:rank]) @ vh[:rank]
    assert objective(ours) <= objective(best) * (1 + 1e-4)


def test_an_output_metric_makes_the_truncation_the_best_of_its_rank_in_kfacs_metric():
    """With `out_gram` `H`, `guarded_whitened_svd` minimises `tr(C dW H dW^T)` (`wo_loss_metric`, §8)
    in the damped metrics it whitens by: its error there is the tail of the singular values of
    `C^(1/2) W H^(1/2)` (another route: eigen square roots), and in the undamped metric it beats the
    input metric's own truncation, which ignores `H`."""
    x, g = _activations(400, 16), _activations(300, 10) @ torch.diag(torch.logspace(1, -1, 10, dtype=D))
    gram, out_gram = x.T @ x / x.shape[0], g.T @ g
    w, rank = torch.randn(16, 10, dtype=D), 4

    def kfac(approx: torch.Tensor, c: torch.Tensor = gram, h: torch.Tensor = out_gram) -> float:
        dw = w - approx
        return float(torch.trace(c @ dw @ h @ dw.T))

    def root(c: torch.Tensor) -> torch.Tensor:
        values, vectors = torch.linalg.eigh(c)
        return vectors @ torch.diag(values.clamp_min(0).sqrt()) @ vectors.T

    (a, b), white = guarded_whitened_svd(w, gram, rank, out_gram)
    (a_in, b_in), _ = guarded_whitened_svd(w, gram, rank)
    c, h = damp(gram, white.eps), damp(out_gram, OUTPUT_EPS)
    tail = float(torch.linalg.svdvals(root(c) @ w @ root(h))[rank:].pow(2).sum())
    assert a.shape == (16, rank) and b.shape == (rank, 10)
    assert kfac(a @ b, c, h) == pytest.approx(tail, rel=1e-6)
    assert kfac(a @ b) < kfac(a_in @ b_in) * 0.9
    (a_id, b_id), _ = guarded_whitened_svd(w, gram, rank, torch.eye(10, dtype=D))
    torch.testing.assert_close(a_id @ b_id, a_in @ b_in)  # an isotropic H is the input metric alone

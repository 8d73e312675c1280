"""Matrix low-rank pieces: budgeted rank, (whitened) truncated SVD, ASVD scaling, W_O calibration.

Used by FTC's output projection (ftc-method.md §8) and by the per-matrix baselines (§11).
Convention: `y = x @ W`, `W (in, out) ~= A @ B` with `A (in, r)`, `B (r, out)`.
"""

from __future__ import annotations

import torch

from .metric import (
    WORK_DTYPE,
    ActivationError,
    Approximation,
    Whitening,
    damped_factor,
    damped_whitenings,
    guarded_fit,
    pivot_signs,
    top_eigenpairs,
)


def rank_within(values: int, rows: int, cols: int) -> int:
    """Largest rank whose two factors `(rows x r)`, `(r x cols)` fit `values` stored values (at least 1)."""
    return max(1, values // (rows + cols))


def budget_rank(rows: int, cols: int, keep_ratio: float) -> int:
    """Largest rank whose two factors fit `keep_ratio * rows * cols` values (§1; at least 1)."""
    return rank_within(int(keep_ratio * rows * cols), rows, cols)


def truncated_svd(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-`rank` Frobenius approximation `A @ B`, singular values split evenly.

    The even split keeps both factors in the same numeric range, which matters once they are
    stored in 16-bit floats. The factors come from the float64 eigenvectors of the smaller Gram
    (`W W^T` or `W^T W`) for the `rank` largest values (`top_eigenpairs`), with canonical signs
    (ftc-method.md §16), not from an SVD: the same top-`rank` singular pairs (to float64 rounding
    where the spectrum has a gap; `A @ B` is the projection of `W` onto them in any case) in a
    fraction of the memory and time. LAPACK's SVD holds a copy, both factors and a workspace of
    four times the matrix; at a 7B model's `W_O` (4096 x 4096) that was the compression's peak
    (benchmarks/results/memory.md). Float32 would not do: its vectors move by 1e-4 with the thread
    count.
    """
    w = w.to(WORK_DTYPE)
    rows, cols = w.shape
    rank = min(rank, rows, cols)
    left = rows <= cols  # the Gram of the shorter side
    values, top = top_eigenpairs(w @ w.T if left else w.T @ w, rank, owned=True)
    root = values.clamp_min(0).pow(0.25)  # sqrt of each singular value
    inverse = torch.where(root > 0, root.reciprocal(), torch.zeros_like(root))  # a null direction adds nothing
    if left:  # top = U: A = U sqrt(S), B = sqrt(S)^-1 U^T W = sqrt(S) V^T
        a, b = top * root, inverse[:, None] * (top.T @ w)
    else:  # top = V: A = W V sqrt(S)^-1 = U sqrt(S), B = sqrt(S) V^T
        a, b = (w @ top) * inverse, root[:, None] * top.T
    signs = pivot_signs(a)  # a sign flip on both sides leaves A @ B unchanged
    return a * signs, signs[:, None] * b


def whitened_svd(w: torch.Tensor, whitening: Whitening, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation-weighted truncated SVD: SVD of `R^T W`, then `A = R^{-T} A~` (§3, §8; SVD-LLM).

    The factor is released during the SVD and the whitened matrix before `unapply` forms the factor
    again, so the two are never resident side by side (134 MB each at width 4096, in the `W_O`
    truncation steps of benchmarks/results/memory.md)."""
    white = whitening.apply(w.to(WORK_DTYPE))
    whitening.release()  # formed again for `unapply`: not resident beside the SVD
    a, b = truncated_svd(white, rank)
    del white  # spent: not resident beside the factor `unapply` forms again
    return whitening.unapply(a), b


ASVD_ALPHA = 0.5
"""ASVD's exponent on the per-channel mean |x| that scales the input channels (§11)."""


def scaled_svd(
    w: torch.Tensor, abs_mean: torch.Tensor, rank: int, alpha: float = ASVD_ALPHA
) -> tuple[torch.Tensor, torch.Tensor]:
    """ASVD: scale input channels by `mean|x|^alpha`, truncate, undo the scaling on `A`."""
    scale = abs_mean.to(WORK_DTYPE).clamp_min(1e-6) ** alpha
    a, b = truncated_svd(scale[:, None] * w.to(WORK_DTYPE), rank)
    return a / scale[:, None], b


COLUMNS = 512
"""Columns per step of `anchored_rhs`: its float64 temporaries are this wide, not `out`."""


def anchored_rhs(
    cross_sum: torch.Tensor, count: int, gram_tt: torch.Tensor, w_o: torch.Tensor, anchor: float
) -> torch.Tensor:
    """Right side of `W_O`'s anchored normal equations, `A_s^T A_t W_O / n + a C_t W_O` (§8).

    Takes the raw cross sum `A_s^T A_t` and converts `W_O` to float64 `COLUMNS` columns at
    a time, so nothing d x d is allocated beside the Grams but the result (each is 134 MB at
    width 4096, and this step sets the 7B-shaped peak; benchmarks/results/memory.md).
    """
    rhs = torch.empty(cross_sum.shape[0], w_o.shape[1], dtype=WORK_DTYPE, device=cross_sum.device)
    for start in range(0, w_o.shape[1], COLUMNS):
        part = w_o[:, start : start + COLUMNS].to(WORK_DTYPE)
        rhs[:, start : start + COLUMNS] = (cross_sum @ part).div_(max(count, 1)).addmm_(gram_tt, part, alpha=anchor)
    return rhs


def calibrated_wo(
    lhs: torch.Tensor, rhs: torch.Tensor, w_o: torch.Tensor, eps: float | None = None
) -> tuple[torch.Tensor, float | None]:
    """Teacher-calibrated output projection with teacher-Gram anchoring (§8), and the `eps` used.

    Solves `(C_s + a C_t) W* = rhs` for `lhs = C_s + a C_t` and `rhs` from `anchored_rhs`: the
    minimiser of `||A_s W - A_t W_O||^2 + a ||A_t (W - W_O)||^2`. With `A_s == A_t` the solution
    is `W_O` itself. The damping of `lhs` rises tenfold while the solve is not finite (§3); if none
    is, the pretrained weight is kept and `eps` is None. The caller forms `lhs`, in place where
    it owns the Grams (FTC's `o`), so no d x d sum is allocated beside them.
    """
    for level in damped_whitenings(lhs, eps):
        solution = torch.cholesky_solve(rhs, level.chol)
        if bool(torch.isfinite(solution).all()):
            return solution, level.eps
    return w_o.to(WORK_DTYPE), None


def weighted_error(
    w: torch.Tensor,
    approx: Approximation,
    gram: torch.Tensor | None,
    balance: bool = False,
    weights: torch.Tensor | None = None,
) -> float:
    """Relative activation-weighted error of one approximation (`metric.ActivationError`, which a
    caller measuring several approximations of the same weights keeps instead)."""
    return ActivationError(w, gram, balance, weights)(approx)


def eig_whitened_svd(w: torch.Tensor, gram: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SVD-LLM V2's loss-optimised truncation: whiten by the Gram's eigendecomposition, not Cholesky.

    `C = U diag(l) U^T`; the SVD of `D = diag(l)^(1/2) U^T W` truncated to `A~ B` gives
    `A = U diag(l)^(-1/2) A~`, which reaches the minimum `||X (W - A B)||` of rank `rank` (the tail
    of `D`'s spectrum) with no damping. Eigenvalues are floored at `1e-12 * max(l)`: directions
    the calibration never excites cost nothing either way.
    """
    values, vectors = torch.linalg.eigh(gram.to(WORK_DTYPE))
    values = values.clamp_min(float(values.max()) * 1e-12)
    root = values.sqrt()
    a, b = truncated_svd(root[:, None] * (vectors.T @ w.to(WORK_DTYPE)), rank)
    return vectors @ (a / root[:, None]), b


OUTPUT_EPS = 1e-3
"""Damping of an output metric (`guarded_whitened_svd`'s `out_gram`), relative to its mean diagonal,
as the input Grams' `DEFAULT_EPS` (§3) **[choice]**: the value of the one-off runs on the tuning
split that measured the loss metric (docs/results.md; 1e-1 measured within 0.6% of it)."""


def guarded_whitened_svd(
    w: torch.Tensor, gram: torch.Tensor | None, rank: int, out_gram: torch.Tensor | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], Whitening]:
    """`whitened_svd` under the outcome guard of §3: the reference is the plain truncated SVD.

    With `out_gram` `H` (`out x out`; the loss gradient's Gram at the output, `wo_loss_metric`) the
    truncation minimises K-FAC's `tr(C dW H dW^T)` instead of `tr(dW^T C dW)`: with `H = L L^T`
    (damped by `OUTPUT_EPS`) that is `tr(C dV dV^T)` for `V = W L`, so `V` is fitted as `W` would be,
    guard included, and `L^-1` is applied to its right factor. An `H` that does not factorise is
    ignored: the input metric alone.

    `L` is not held during the fit, whose peak it would raise by an `out x out` float64 matrix (134 MB
    at width 4096): formed again for `L^-1`, to the same bits (`damped_factor`, which also evicts `H`
    when it is a spilled Gram).
    """
    right = None if out_gram is None else damped_factor(out_gram, OUTPUT_EPS)
    weighted = right is not None
    if weighted:
        w = w.to(WORK_DTYPE) @ right
        del right
    error = ActivationError(w, gram)
    (a, b), whitening = guarded_fit(gram, lambda white: whitened_svd(w, white, rank), error,
                                    lambda: error(truncated_svd(w, rank)))
    if weighted:
        right = damped_factor(out_gram, OUTPUT_EPS)  # the same bits as above
        b = torch.linalg.solve_triangular(right.to(b.dtype), b, upper=False, left=False)
    return (a, b), whitening


__all__ = [
    "anchored_rhs",
    "budget_rank",
    "calibrated_wo",
    "eig_whitened_svd",
    "guarded_whitened_svd",
    "rank_within",
    "scaled_svd",
    "truncated_svd",
    "weighted_error",
    "whitened_svd",
]

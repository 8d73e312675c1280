"""Matrix low-rank pieces: budgeted rank, (whitened) truncated SVD, ASVD scaling, W_O calibration.

Used by FTC's output projection (ftc-method.md §8) and by the per-matrix baselines (§11).
Convention: `y = x @ W`, `W (in, out) ~= A @ B` with `A (in, r)`, `B (r, out)`.
"""

from __future__ import annotations

import torch

from .metric import DEFAULT_EPS, WORK_DTYPE, Whitening, damped_factors, guarded_fit, relative_error


def budget_rank(rows: int, cols: int, keep_ratio: float) -> int:
    """Largest rank whose two factors fit `keep_ratio * rows * cols` values (at least 1)."""
    return max(1, int(keep_ratio * rows * cols / (rows + cols)))


FACTOR_DTYPE = torch.float32
"""Precision of the truncated SVDs (see `truncated_svd`)."""


def truncated_svd(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-`rank` Frobenius approximation `A @ B`, singular values split evenly.

    The even split keeps both factors in the same numeric range, which matters once they are
    stored in 16-bit floats. The SVD itself runs in float32 (`FACTOR_DTYPE`), about twice as fast
    as float64 and far more precise than the 16-bit factors it produces; ill-conditioning is the
    metric's problem, and whitening and its inverse stay in float64. Factors come back in float64.
    """
    u, s, vh = torch.linalg.svd(w.to(FACTOR_DTYPE), full_matrices=False)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).to(WORK_DTYPE), (root[:, None] * vh[:rank]).to(WORK_DTYPE)


def whitened_svd(w: torch.Tensor, whitening: Whitening, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation-weighted truncated SVD: SVD of `R^T W`, then `A = R^{-T} A~` (§3, §8; SVD-LLM)."""
    # converted before the call, so the float64 product is freed before the SVD's workspace exists
    white = whitening.apply(w.to(WORK_DTYPE)).to(FACTOR_DTYPE)
    a, b = truncated_svd(white, rank)
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
"""Columns per step of `anchored_rhs` and `weighted_error`: their float64 temporaries are this
wide, not `out`."""


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
    lhs: torch.Tensor, rhs: torch.Tensor, w_o: torch.Tensor, eps: float = DEFAULT_EPS
) -> tuple[torch.Tensor, float | None]:
    """Teacher-calibrated output projection with teacher-Gram anchoring (§8), and the `eps` used.

    Solves `(C_s + a C_t) W* = rhs` for `lhs = C_s + a C_t` and `rhs` from `anchored_rhs`: the
    minimiser of `||A_s W - A_t W_O||^2 + a ||A_t (W - W_O)||^2`. With `A_s == A_t` the solution
    is `W_O` itself. The damping of `lhs` rises tenfold while the solve is not finite (§3); if none
    is, the pretrained weight is kept and `eps` is None. The caller forms `lhs`, in place where
    it owns the Grams (FTC's `o`), so no d x d sum is allocated beside them.
    """
    for chol, used in damped_factors(lhs, eps):
        solution = torch.cholesky_solve(rhs, chol)
        if bool(torch.isfinite(solution).all()):
            return solution, used
    return w_o.to(WORK_DTYPE), None


def weighted_error(
    w: torch.Tensor,
    approx: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    gram: torch.Tensor | None,
    balance: bool = False,
    weights: torch.Tensor | None = None,
) -> float:
    """Relative activation-weighted error `sum_s a_s tr(dW_s^T C dW_s) / sum_s a_s tr(W_s^T C W_s)`.

    `w` is one matrix `(in, out)` or a stack of slices `(S, in, out)`; the identity metric if
    `gram` is None. `balance` weighs each slice by `a_s = 1 / tr(W_s^T C W_s)`, so every slice's
    relative error counts the same (the objective of slice balancing, §4); otherwise `a_s = 1`.
    `weights` multiply `a_s` (`metric.relative_error`).
    `approx` is a tensor of `w`'s shape or, for one matrix, its factors `(A, B)`, multiplied out
    `COLUMNS` columns at a time: no d x d float64 product beside `w` (134 MB at width 4096).
    """
    w = w if w.dim() == 3 else w[None]
    if isinstance(approx, tuple):
        left = approx[0].to(WORK_DTYPE)
        right = approx[1]

        def columns(cut: slice) -> torch.Tensor:
            return (left @ right[:, cut].to(WORK_DTYPE))[None]
    else:
        whole = approx.reshape(w.shape)

        def columns(cut: slice) -> torch.Tensor:
            return whole[..., cut].to(WORK_DTYPE)

    gram = None if gram is None else gram.to(WORK_DTYPE)
    energy = torch.zeros(w.shape[0], dtype=WORK_DTYPE, device=w.device)
    err = torch.zeros_like(energy)
    for start in range(0, w.shape[2], COLUMNS):  # float64 temporaries of a few columns at a time
        part = w[..., start : start + COLUMNS].to(WORK_DTYPE)
        diff = part - columns(slice(start, start + COLUMNS))
        if gram is None:
            energy += part.pow(2).sum((1, 2))
            err += diff.pow(2).sum((1, 2))
        else:
            energy += (part * (gram @ part)).sum((1, 2))
            err += (diff * (gram @ diff)).sum((1, 2))
    return relative_error(err, energy, balance, weights)


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


def guarded_whitened_svd(
    w: torch.Tensor, gram: torch.Tensor | None, rank: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], Whitening]:
    """`whitened_svd` under the outcome guard of §3: the reference is the plain truncated SVD."""

    def error(factors: tuple[torch.Tensor, torch.Tensor]) -> float:
        return weighted_error(w, factors, gram)

    return guarded_fit(gram, lambda white: whitened_svd(w, white, rank), error,
                       lambda: error(truncated_svd(w, rank)))


__all__ = [
    "anchored_rhs",
    "budget_rank",
    "calibrated_wo",
    "eig_whitened_svd",
    "guarded_whitened_svd",
    "scaled_svd",
    "truncated_svd",
    "weighted_error",
    "whitened_svd",
]

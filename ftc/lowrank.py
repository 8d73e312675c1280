"""Matrix low-rank pieces: budgeted rank, (whitened) truncated SVD, ASVD scaling, W_O calibration.

Used by FTC's output projection (ftc-method.md §8) and by the per-matrix baselines (§11).
Convention: `y = x @ W`, `W (in, out) ~= A @ B` with `A (in, r)`, `B (r, out)`.
"""

from __future__ import annotations

import torch

from .metric import WORK_DTYPE, Whitening, guarded_cholesky


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
    a, b = truncated_svd(whitening.apply(w.to(WORK_DTYPE)), rank)
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


def calibrated_wo(
    gram_ss: torch.Tensor,
    gram_tt: torch.Tensor,
    gram_st: torch.Tensor,
    w_o: torch.Tensor,
    anchor: float = 0.5,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Teacher-calibrated output projection with teacher-Gram anchoring (§8).

    Solves `(A_s^T A_s + a A_t^T A_t) W* = A_s^T A_t W_O + a A_t^T A_t W_O` with every Gram
    normalised by n. With `A_s == A_t` the solution is `W_O` itself.
    """
    w_o = w_o.to(WORK_DTYPE)
    lhs = gram_ss + anchor * gram_tt
    rhs = (gram_st + anchor * gram_tt) @ w_o
    chol, _ = guarded_cholesky(lhs, eps)
    if chol is None:  # a degenerate student: keep the pretrained weight
        return w_o
    return torch.cholesky_solve(rhs, chol)


def weighted_error(w: torch.Tensor, approx: torch.Tensor, gram: torch.Tensor | None) -> float:
    """Relative activation-weighted error `tr(dW^T C dW) / tr(W^T C W)` (identity metric if None)."""
    w = w.to(WORK_DTYPE)
    diff = w - approx.to(WORK_DTYPE)
    if gram is None:
        return float(diff.pow(2).sum() / w.pow(2).sum())
    return float((diff * (gram @ diff)).sum() / (w * (gram @ w)).sum())


__all__ = [
    "budget_rank",
    "calibrated_wo",
    "scaled_svd",
    "truncated_svd",
    "weighted_error",
    "whitened_svd",
]

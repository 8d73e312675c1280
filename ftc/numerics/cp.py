"""Rank-R CP compression of the joint Q/K/V tensor (ftc-method.md §14, on the tensor of §2-§4).

The same whitened, slice-balanced `(S, d, dh)` head-concat tensor as FTC (`tucker.py`), but each
slice is a diagonal mix of R shared rank-1 terms instead of a dense per-slice core:

    B_s ~= A diag(c_s) B^T,   A (d x R), B (dh x R), C (S x R) with row s = c_s.

This is the CP decomposition `sum_r a_r (x) b_r (x) c_r`; a rank-R Kronecker-product
decomposition of the same weights is the same model. R usually exceeds `dh` (and can exceed `d`),
so the factors cannot be orthonormal and no closed form exists: the fit is alternating least
squares (ALS) in the whitened metric, each factor solved from its normal equations, whose matrix
is a Hadamard product of the other two factors' Grams and whose right-hand side is an MTTKRP
computed by contracting the tensor with one factor at a time (the Khatri-Rao product is never
formed). Against the usual ALS swamps every block update carries a proximal term and every sweep
tries an extrapolated step that is kept only when it lowers the error, so the error never rises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metric import WORK_DTYPE, Whitening
from .tucker import hosvd, tie_key, whiten_and_balance

MAX_SWEEPS = 30
"""ALS sweeps at most **[choice]**: the relative improvement usually falls below `TOLERANCE` first."""

TOLERANCE = 1e-3
"""Stop once a sweep lowers the error by less than this fraction of it **[choice]**."""

PROXIMAL = 1e-3
"""Proximal weight of each block update, relative to the mean diagonal of its normal matrix
**[choice]**: keeps the solve well posed when R exceeds a dimension and damps swamps."""

EXTRAPOLATION_POWER = 1 / 3
"""Sweep k tries `X + k^p (X - X_prev)` (Bro's line search) and keeps it only if the error falls
**[choice]**."""


# ---------------------------------------------------------------------------------------------
# storage accounting (same budget as §1)


def cp_storage_values(d: int, dh: int, slices: int, rank: int) -> int:
    """Stored values of a CP Q/K/V layer: `R (d + dh + S)` (no mask, no core)."""
    return rank * (d + dh + slices)


def cp_rank(budget: int, d: int, dh: int, slices: int) -> int:
    """Largest R with `R (d + dh + S) <= budget`; the budget is `rho d dh S` as for FTC (§1)."""
    rank = budget // (d + dh + slices)
    if rank < 1:
        raise ValueError(f"budget of {budget} values cannot hold a rank-1 CP term ({d}+{dh}+{slices} values)")
    return rank


# ---------------------------------------------------------------------------------------------
# the model and its error


def cp_reconstruct(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`A diag(c_s) B^T` for every slice, shape `(S, d, dh)`."""
    return (a * c[:, None, :]) @ b.T


def _model_norm2(ga: torch.Tensor, gb: torch.Tensor, gc: torch.Tensor) -> torch.Tensor:
    """`||sum_r a_r (x) b_r (x) c_r||^2 = 1^T (A^T A * B^T B * C^T C) 1` from the three Grams."""
    return (ga * gb * gc).sum()


def cp_error(tensor: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> float:
    """`||T - [[A, B, C]]||_F^2` without forming the reconstruction."""
    inner = torch.einsum("sdr,dr,sr->", tensor @ b, a, c)
    return float(tensor.pow(2).sum() - 2 * inner + _model_norm2(a.T @ a, b.T @ b, c.T @ c))


# ---------------------------------------------------------------------------------------------
# initialisation from the HOSVD


def hosvd_init(tensor: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-R start from the HOSVD (§5): the R heaviest `(i, j)` fibres of the full core.

    With orthonormal `U1`, `U2` the tensor is exactly `sum_{i,j} u1_i (x) u2_j (x) G[:, i, j]`, a
    CP of rank `m1 m2` whose terms are orthogonal. Keeping the R terms of largest energy
    `sum_s G[s, i, j]^2` is the best CP whose `(a_r, b_r)` are HOSVD vector pairs, and it pads
    naturally when R exceeds `dh` or `d`: one `u2_j` (or `u1_i`) serves several terms.
    """
    u1, u2, core = hosvd(tensor)
    energy = core.pow(2).sum(0)  # (m1, m2)
    if rank > energy.numel():
        raise ValueError(f"CP rank {rank} exceeds the {energy.numel()} HOSVD terms; the tensor needs no more")
    flat = torch.sort(tie_key(energy.flatten()), descending=True, stable=True).indices[:rank]  # ties by index (§16)
    i, j = flat // energy.shape[1], flat % energy.shape[1]
    return u1[:, i], u2[:, j], core[:, i, j]


# ---------------------------------------------------------------------------------------------
# alternating least squares


@dataclass(frozen=True)
class CPFit:
    """Factors of `T ~= [[A, B, C]]` and the path that led there."""

    a: torch.Tensor  # (d, R)
    b: torch.Tensor  # (dh, R), unit columns
    c: torch.Tensor  # (S, R)
    errors: tuple[float, ...]
    """Relative squared error `||T - [[A, B, C]]||^2 / ||T||^2` at the start and after each sweep."""
    extrapolated: int
    """Sweeps whose extrapolated step was kept."""

    @property
    def sweeps(self) -> int:
        return len(self.errors) - 1


def _proximal_solve(gram: torch.Tensor, rhs: torch.Tensor, previous: torch.Tensor, weight: float) -> torch.Tensor:
    """`argmin_X ||T - ...||^2 + lam ||X - X_prev||^2`: `X (V + lam I) = M + lam X_prev`.

    Being the exact minimiser of the error plus a term that is zero at `X_prev`, the update
    cannot raise the error; the added `lam I` keeps `V` (singular when R exceeds a dimension)
    invertible.
    """
    lam = weight * float(gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny))
    system = gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    chol, info = torch.linalg.cholesky_ex(system)
    if int(info) != 0:  # lost positive definiteness to rounding: the symmetric solve still works
        return torch.linalg.solve(system, (rhs + lam * previous).T).T
    return torch.cholesky_solve((rhs + lam * previous).T, chol).T


@dataclass
class _State:
    """Factors, their Grams and `q = T B`: everything a sweep reuses instead of recomputing."""

    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    ga: torch.Tensor
    gb: torch.Tensor
    gc: torch.Tensor
    q: torch.Tensor | None

    @classmethod
    def of(cls, tensor: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, q=None) -> _State:
        return cls(a, b, c, a.T @ a, b.T @ b, c.T @ c, tensor @ b if q is None else q)

    def error(self, total: torch.Tensor) -> float:
        """`||T||^2 - 2 <T, [[A, B, C]]> + ||[[A, B, C]]||^2`, the inner product from `q`."""
        inner = torch.einsum("sdr,dr,sr->", self.q, self.a, self.c)
        return float(total - 2 * inner + _model_norm2(self.ga, self.gb, self.gc))

    def normalised(self) -> _State:
        """Unit columns in A and B, the scale in C: the same model, no drift between factors."""
        tiny = torch.finfo(self.a.dtype).tiny
        na, nb = self.ga.diagonal().sqrt().clamp_min(tiny), self.gb.diagonal().sqrt().clamp_min(tiny)
        nc = na * nb
        return _State(self.a / na, self.b / nb, self.c * nc, self.ga / torch.outer(na, na),
                      self.gb / torch.outer(nb, nb), self.gc * torch.outer(nc, nc), self.q / nb)


def _sweep(tensor: torch.Tensor, s: _State, proximal: float) -> tuple[_State, float]:
    """One ALS sweep over A, B, C; returns the new state and its absolute squared error.

    Two contractions of the tensor: `T B` (carried in from the previous sweep) feeds the A
    update, `T^T A` with the new A feeds both the B and the C updates (MTTKRPs of modes 2, 3).
    """
    a = _proximal_solve(s.gb * s.gc, torch.einsum("sdr,sr->dr", s.q, s.c), s.a, proximal)
    ga = a.T @ a
    p = tensor.transpose(1, 2) @ a  # (S, dh, R)
    b = _proximal_solve(ga * s.gc, torch.einsum("sjr,sr->jr", p, s.c), s.b, proximal)
    gb = b.T @ b
    m_c = torch.einsum("sjr,jr->sr", p, b)
    c = _proximal_solve(ga * gb, m_c, s.c, proximal)
    gc = c.T @ c
    error = float(tensor.pow(2).sum() - 2 * (m_c * c).sum() + _model_norm2(ga, gb, gc))
    return _State(a, b, c, ga, gb, gc, None), error  # `T B` only if no extrapolated step replaces it


def cp_als(
    tensor: torch.Tensor,
    rank: int,
    *,
    max_sweeps: int = MAX_SWEEPS,
    tolerance: float = TOLERANCE,
    proximal: float = PROXIMAL,
    extrapolation_power: float | None = EXTRAPOLATION_POWER,
) -> CPFit:
    """Fit `T_s ~= A diag(c_s) B^T` by ALS from the HOSVD start (`tensor` is `(S, d, dh)`).

    Per sweep: the normal equations of each factor (Hadamard products of R x R Grams, MTTKRPs
    from contractions of the tensor with one factor), then an extrapolated step
    `X + k^p (X - X_prev)` kept only if it lowers the error. Stops when a sweep improves the
    error by less than `tolerance` of it, at `max_sweeps`, or once the fit is exact to rounding.
    `extrapolation_power=None` turns the line search off.
    """
    total = tensor.pow(2).sum()
    floor = float(total) * torch.finfo(tensor.dtype).eps ** 2
    state = _State.of(tensor, *hosvd_init(tensor, rank)).normalised()
    error = state.error(total)
    errors, extrapolated = [error / float(total)], 0
    for sweep in range(1, max_sweeps + 1):
        new, new_error = _sweep(tensor, state, proximal)
        if extrapolation_power is not None:
            step = sweep**extrapolation_power
            trial = _State.of(tensor, *(x + step * (x - x0) for x, x0 in
                                        zip((new.a, new.b, new.c), (state.a, state.b, state.c), strict=True)))
            trial_error = trial.error(total)
            if trial_error < new_error:  # the guard that keeps the error monotone
                new, new_error, extrapolated = trial, trial_error, extrapolated + 1
        if new.q is None:
            new.q = tensor @ new.b
        state = new.normalised()
        improvement = (error - new_error) / max(error, floor)
        error = new_error
        errors.append(error / float(total))
        if improvement < tolerance or error <= floor:
            break
    return CPFit(state.a, state.b, state.c, tuple(errors), extrapolated)


# ---------------------------------------------------------------------------------------------
# the whole Q/K/V step


@dataclass(frozen=True)
class CPFactors:
    """A compressed joint tensor: `W_s ~= A_hat diag(c_s) B^T` (stored group kind `cp`)."""

    a: torch.Tensor  # (d, R), un-whitened
    b: torch.Tensor  # (dh, R)
    c: torch.Tensor  # (S, R), slice norms multiplied back

    @property
    def stored_values(self) -> int:
        (d, rank), dh, slices = self.a.shape, self.b.shape[0], self.c.shape[0]
        return cp_storage_values(d, dh, slices, rank)

    def weights(self, slices: slice = slice(None), columns: slice = slice(None)) -> torch.Tensor:
        """The reconstructed `(S, d, dh)` tensor, or its block `[slices, :, columns]`."""
        dtype = self.a.dtype
        return cp_reconstruct(self.a, self.b[columns].to(dtype), self.c[slices].to(dtype))


@dataclass(frozen=True)
class CPReport:
    rank: int
    eps: float | None
    error_init: float
    """Relative squared error of the balanced whitened tensor at the HOSVD start."""
    error: float
    """The same for the returned factors, measured directly (not from the ALS bookkeeping)."""
    sweeps: int
    extrapolated: int


def compress_cp(
    tensor: torch.Tensor,
    whitening: Whitening,
    budget: int,
    *,
    balance: bool = True,
    max_sweeps: int = MAX_SWEEPS,
    tolerance: float = TOLERANCE,
    weights: torch.Tensor | None = None,
) -> tuple[CPFactors, CPReport]:
    """Whiten, balance, fit a budget-sized CP by ALS, then undo balancing and whitening.

    `tensor` is `(S, d, dh)` in `(in, out)` layout per slice; `budget` counts stored values;
    `weights` weigh the slices' shares of the objective as in FTC (`whiten_and_balance`). The
    ALS runs in float64 on the tensor of `whiten_and_balance`, like FTC's refits (§16), and the
    reported error is measured on the returned factors. Each term's scale is split evenly over its
    three factors so all of them stay in 16-bit range.
    """
    slices, d, dh = tensor.shape
    balanced, norms = whiten_and_balance(tensor, whitening, balance, weights)
    rank = min(cp_rank(budget, d, dh, slices), min(d, slices * dh) * min(dh, slices * d))
    fit = cp_als(balanced, rank, max_sweeps=max_sweeps, tolerance=tolerance)
    a, b, c = fit.a, fit.b, fit.c
    scale = c.norm(dim=0).clamp_min(torch.finfo(WORK_DTYPE).tiny) ** (1 / 3)
    a, b, c = a * scale, b * scale, c / scale**2
    error = float((balanced - cp_reconstruct(a, b, c)).pow(2).sum() / balanced.pow(2).sum())
    factors = CPFactors(a=whitening.unapply(a), b=b, c=c * norms[:, None])
    report = CPReport(rank, whitening.eps, fit.errors[0], error, fit.sweeps, fit.extrapolated)
    return factors, report

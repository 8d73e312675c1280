"""Shared-factor Tucker compression of the joint Q/K/V tensor (ftc-method.md §2, §4-§7).

Layout: the head-concat tensor is held slice-first, `W[s] = W_s (d x dh)`, shape `(S, d, dh)`,
and the core likewise `G[s] = G_s (r1 x r2)`, shape `(S, r1, r2)`. This is the `(d, dh, S)`
tensor of the method text with the slice mode moved to the front, which turns every per-slice
product into one batched matmul. Slice order: query heads, then key heads, then value heads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .metric import WORK_DTYPE, Whitening, pivot_signs, top_eigenpairs

MASK_UNIT_BITS = 16
"""The support mask is counted in units of one 16-bit stored value (§1)."""

GRID_POINTS = 16
"""Coarse allocation grid: this many `r1` values by half as many `r2` values, then refined (§6)."""
PRUNE_STEPS = 8
"""Steps of the geometric schedule from the dense core down to `K` entries (§7)."""
REFITS = 2
"""Alternating factor/core refits after each pruning step (§7)."""
TIE_TOLERANCE = 1e-9
"""Relative difference below which two candidates are a tie (§16): core magnitudes in the top-K
selection, predicted errors in the allocation, the gradual and one-shot results of §7. A tie goes
to the lower index or the earlier candidate. Float64 results move by about 1e-13 relative between
thread counts, so no choice then depends on the build; differences this small change no error that
matters."""


# ---------------------------------------------------------------------------------------------
# §2 the head-concat tensor


def head_slices(w: torch.Tensor, head_dim: int, repeat: int = 1) -> torch.Tensor:
    """One projection `(d, heads*dh)` as `(heads*repeat, d, dh)` slices, copies adjacent."""
    heads = w.reshape(w.shape[0], -1, head_dim).permute(1, 0, 2)
    return heads.repeat_interleave(repeat, dim=0) if repeat > 1 else heads


def head_concat(
    w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, head_dim: int, kv_repeat: int = 1
) -> torch.Tensor:
    """Stack Q, K, V head slices (each `d x dh`, weights in `(in, out)` layout) into `(S, d, dh)`.

    GQA/MQA key/value heads appear once; `kv_repeat > 1` is the ablation that repeats each of
    them `kv_repeat` times (adjacent copies, matching how grouped query heads share them).
    """
    return torch.cat(
        [
            head_slices(w_q, head_dim),
            head_slices(w_k, head_dim, kv_repeat),
            head_slices(w_v, head_dim, kv_repeat),
        ]
    )


# ---------------------------------------------------------------------------------------------
# §1 storage accounting


def mask_units(r1: int, r2: int, slices: int) -> int:
    """Bit-packed support mask, `r1*r2*S` bits, in 16-bit units."""
    return math.ceil(r1 * r2 * slices / MASK_UNIT_BITS)


def storage_values(d: int, dh: int, slices: int, r1: int, r2: int, kept: int, mode2: bool = True) -> int:
    """Stored values of a Tucker group: factors + kept core values (+ mask if sparse). Without a
    mode-2 factor (`mode2=False`, §17: `U2` the identity, `r2 = dh`) only `U1` is a factor."""
    dense = kept >= r1 * r2 * slices
    return d * r1 + (dh * r2 if mode2 else 0) + (r1 * r2 * slices if dense else kept + mask_units(r1, r2, slices))


def core_capacity(budget: int, d: int, dh: int, slices: int, r1: int, r2: int, mode2: bool = True) -> int:
    """Largest core count `K` that fits `budget` at ranks `(r1, r2)`; `r1*r2*S` means dense, 0 none."""
    full = r1 * r2 * slices
    free = budget - d * r1 - (dh * r2 if mode2 else 0)
    if free >= full:
        return full
    return max(0, min(full - 1, free - mask_units(r1, r2, slices)))


# ---------------------------------------------------------------------------------------------
# §4-§5 balancing and HOSVD


def slice_norms(tensor: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of every slice, floored so an all-zero slice stays finite."""
    return tensor.flatten(1).norm(dim=1).clamp_min(torch.finfo(tensor.dtype).tiny)


def mode1_unfold(tensor: torch.Tensor) -> torch.Tensor:
    """`[B_1 ... B_S]`, shape `(d, S*dh)`."""
    return tensor.permute(1, 0, 2).reshape(tensor.shape[1], -1)


def mode2_unfold(tensor: torch.Tensor) -> torch.Tensor:
    """`[B_1^T ... B_S^T]`, shape `(dh, S*d)`."""
    return tensor.permute(2, 0, 1).reshape(tensor.shape[2], -1)


def times_u2(tensor: torch.Tensor, u2: torch.Tensor | None) -> torch.Tensor:
    """`(B_s U2)^T = U2^T B_s^T` for every slice, shape `(S, r2, d)` (`B_s^T` when `U2` is the
    identity, None).

    Kept transposed so that both uses are plain GEMMs over a free reshape: the core
    (`(S r2, d) @ (d, r1)`) and the `U1` update (`(d, S r2) @ (S r2, r1)`).
    """
    return tensor.mT if u2 is None else u2.T @ tensor.mT


def core_from(tu2: torch.Tensor, u1: torch.Tensor) -> torch.Tensor:
    """`G_s = U1^T (B_s U2)` from `times_u2`'s products, written straight into the `(S, r1, r2)` layout.

    `U1^T` against the transposed view of every slice: the same products as one `(S r2, d) @ (d, r1)`
    GEMM, without its `(S, r2, r1)` result and the transposed copy of it (two core-sized temporaries).
    """
    return u1.T @ tu2.mT


def project_core(tensor: torch.Tensor, u1: torch.Tensor, u2: torch.Tensor | None, into_tensor: bool = False
                 ) -> torch.Tensor:
    """`G_s = U1^T B_s U2` for every slice, as `U1^T (B_s U2)`: the narrow factor `U2` goes first.

    `GRAM_SLICES` slices at a time into the core: the HOSVD's `U2` is square, so `B_s U2` of every
    slice at once would be a float64 temporary the size of the tensor (201 MB at a 7B-shaped
    layer, part of its Q/K/V peak; benchmarks/results/memory.md). Each slice's products are the same.
    `into_tensor` writes the core over the (contiguous) tensor's own buffer, which is spent: the
    core's slices before `b` span no more than the tensor's first `b` slices, all read by then.
    """
    shape = (tensor.shape[0], u1.shape[1], tensor.shape[2] if u2 is None else u2.shape[1])
    core = tensor.view(-1)[: math.prod(shape)].view(shape) if into_tensor else tensor.new_empty(shape)
    for part, _, block in projected_slices(tensor, u1, u2):
        core[part] = block
    return core


def projected_slices(tensor: torch.Tensor, u1: torch.Tensor, u2: torch.Tensor | None
                     ) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """`(part, B_s U2 of those slices as times_u2 gives it, U1^T B_s U2 of them)`, `GRAM_SLICES`
    slices at a time: the one loop behind the core's projection, the refits' core and `U1` target,
    and `tucker_error`, so none of them holds a tensor-sized product."""
    for start in range(0, tensor.shape[0], GRAM_SLICES):
        part = slice(start, start + GRAM_SLICES)
        tu2 = times_u2(tensor[part], u2)
        yield part, tu2, core_from(tu2, u1)


def times_right(tensor: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """`B_s R` for every slice, products in `R`'s (float64) precision, the result in the tensor's dtype.

    `GRAM_SLICES` slices at a time: the same values as the whole tensor's product, without its two
    tensor-sized float64 temporaries (402 MB at a 7B-shaped Q/K/V tensor, `loss_metric`'s head metric)."""
    out = torch.empty_like(tensor)
    for start in range(0, tensor.shape[0], GRAM_SLICES):
        out[start : start + GRAM_SLICES] = (tensor[start : start + GRAM_SLICES].to(right.dtype) @ right).to(out.dtype)
    return out


def reconstruct(u1: torch.Tensor, core: torch.Tensor, u2: torch.Tensor | None) -> torch.Tensor:
    """`U1 G_s U2^T` for every slice, shape `(S, d, dh)` (`U2` None: the identity)."""
    return u1 @ core if u2 is None else u1 @ core @ u2.T


GRAM_SLICES = 8
"""Slices unfolded (or whitened) at a time: bounds the full-size temporary to a few slices."""


def squared_norm(tensor: torch.Tensor) -> float:
    """`||B||_F^2`, summed a few slices at a time: no full-size temporary of squares."""
    return sum(float(chunk.pow(2).sum()) for chunk in tensor.split(GRAM_SLICES))


def mode1_gram(tensor: torch.Tensor) -> torch.Tensor:
    """`sum_s B_s B_s^T` (d x d), the Gram of the mode-1 unfolding, without unfolding it whole."""
    d = tensor.shape[1]
    gram = tensor.new_zeros(d, d)
    for chunk in tensor.split(GRAM_SLICES):
        unfolded = mode1_unfold(chunk)
        gram.addmm_(unfolded, unfolded.T)
    return gram


def mode2_gram(tensor: torch.Tensor) -> torch.Tensor:
    """`sum_s B_s^T B_s` (dh x dh), the Gram of the mode-2 unfolding (a free reshape)."""
    rows = tensor.reshape(-1, tensor.shape[2])
    return rows.T @ rows


def leading_eigenvectors(gram: torch.Tensor, count: int, owned: bool = False) -> torch.Tensor:
    """The `count` eigenvectors of a symmetric PSD Gram with the largest eigenvalues, largest first.

    These are the left singular vectors of the matrix the Gram was formed from: the HOSVD needs
    no right singular vectors, which for the mode-2 unfolding would be `(dh, S d)`. Solved in
    float64 with canonical signs (§16): eigenvalues near a rank cut lie 1e-6 of the largest apart,
    where float32 resolves about 1e-7 and its vectors move with the thread count. `owned`: the
    caller's float64 `gram` may be overwritten (`top_eigenpairs`).
    """
    vectors = top_eigenpairs(gram, count, owned=owned)[1]
    return vectors * pivot_signs(vectors)


def hosvd_ranks(tensor: torch.Tensor) -> tuple[int, int]:
    """Ranks `(m1, m2)` of the full HOSVD of `(S, d, dh)`: `min(d, S dh)` and `min(dh, S d)`."""
    slices, d, dh = tensor.shape
    return min(d, slices * dh), min(dh, slices * d)


def hosvd(tensor: torch.Tensor, max_r1: int | None = None, mode2: bool = True, consume: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Full HOSVD with the slice mode kept (§5): nested factors, so `G[:, :r1, :r2]` truncates.

    Each factor comes from `eigh` of its unfolding's Gram, `(d x d)` and `(dh x dh)`, rather than
    an SVD of the `(d, S dh)` and `(dh, S d)` unfoldings: the same subspaces, far less work.
    `max_r1` keeps only that many leading mode-1 vectors (and core rows): nesting makes the result
    the leading block of the full one, at the memory of the part a budget can reach. Without
    `mode2` the second factor is the identity (None, §17) and the core `U1^T B_s`. `consume`: the
    core takes the tensor's buffer (`project_core`), for a caller that needs the tensor no more.
    """
    m1, m2 = hosvd_ranks(tensor)
    u1 = leading_eigenvectors(mode1_gram(tensor), m1 if max_r1 is None else max(1, min(m1, max_r1)), owned=True)
    u2 = leading_eigenvectors(mode2_gram(tensor), m2, owned=True) if mode2 else None
    return u1, u2, project_core(tensor, u1, u2, into_tensor=consume)


def tucker_error(tensor: torch.Tensor, u1: torch.Tensor, core: torch.Tensor, u2: torch.Tensor | None) -> float:
    """`||B - U1 G U2^T||_F^2` without forming the reconstruction (U1, U2 orthonormal).

    The inner product `<U1^T B_s U2, G_s>` is summed a few slices at a time, as `project_core`
    projects: no core-sized temporary (it held two at the end of §7, a 7B-shaped layer's peak)."""
    inner = sum(float((block * core[part]).sum()) for part, _, block in projected_slices(tensor, u1, u2))
    return squared_norm(tensor) - 2 * inner + squared_norm(core)


# ---------------------------------------------------------------------------------------------
# §6 budget-coupled allocation


@dataclass(frozen=True)
class Allocation:
    r1: int
    r2: int
    kept: int
    predicted_error: float
    """Absolute squared error of HOSVD factors at `(r1, r2)` with the top-`kept` core (§6)."""


def tie_key(values: torch.Tensor) -> torch.Tensor:
    """`|values|` rounded to steps of `TIE_TOLERANCE` times their largest (float64), so magnitudes
    closer than that compare equal and a stable sort orders them by index (§16). One new buffer."""
    key = values.abs().to(WORK_DTYPE)
    scale = key.max().clamp_min(torch.finfo(WORK_DTYPE).tiny) * TIE_TOLERANCE
    return key.div_(scale).round_()


def largest(values: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` largest entries of a 1-D buffer the caller hands over (it is reordered), unordered.

    On the CPU an in-place partition (NumPy's introselect) that allocates nothing and returns a view
    of the buffer's tail: `torch.topk` holds a (value, int64 index) pair per entry of its input
    beside its values and indices, 32 bytes per float64 entry, which set the memory peak of a
    7B-shaped layer's allocation (benchmarks/results/memory.md). The values are the same; only
    their order differs. On other devices, `torch.topk`.
    """
    if count >= values.numel():
        return values
    if count <= 0:
        return values[:0]
    if values.device.type != "cpu":
        return torch.topk(values, count, sorted=False).values
    cut = values.numel() - count
    values.numpy().partition(cut)
    return values[cut:]


def top_k_mask(core: torch.Tensor, kept: int) -> torch.Tensor:
    """Support of the `kept` largest-magnitude entries: the optimal `kept`-sparse core (§6, E.2).

    Magnitudes within `TIE_TOLERANCE` of each other are ties, resolved toward the lower index (§16):
    near-ties are common (0.00180428 against 0.00180425 on SmolLM2), and a choice among them must
    not depend on rounding that moves with the thread count.

    The support a stable descending sort would give, found by selection (linear, several times
    faster than the sort on the pruning schedule's every step): every key above the `kept`-th
    largest, then the lowest-index entries equal to it until `kept` are chosen.
    """
    flat = core.flatten()
    if kept >= flat.numel():
        return torch.ones_like(core, dtype=torch.bool)
    cut = largest(tie_key(flat), kept).min()
    key = tie_key(flat)  # again rather than a copy kept beside the selection's buffer
    mask = key > cut
    mask[(key == cut).nonzero()[: kept - int(mask.sum()), 0]] = True
    return mask.view_as(core)


def clearly_below(value: float, other: float) -> bool:
    """`value < other` by more than `TIE_TOLERANCE` of the larger magnitude: a choice between two
    candidates that are equal up to rounding keeps the earlier one (§16)."""
    return value < other - TIE_TOLERANCE * max(abs(value), abs(other))


class EnergyTable:
    """Top-K retained energy of `G[:, :r1, :r2]` for many `(r1, r2, K)`, from one squared core.

    The squares are the core's own buffer when the caller hands it over (`owned`): no second
    core-sized table beside it. Each candidate copies what it selects from into one pool and takes
    a partial selection (`largest`), linear in the pool. Candidates in the coarse grid's order
    (one `r2`, `r1` up, so `K` down) select from less: the top `K'` of a larger block lie among
    the previous candidate's top `K >= K'` and the rows added since (anything else is beaten by
    `K` entries already), so that pool replaces the whole block.
    """

    def __init__(self, core: torch.Tensor, owned: bool = False) -> None:
        self.squares = core.square_() if owned else core.square()
        self._last: tuple[int, int, int, torch.Tensor] | None = None  # (r1, r2, K, the top-K values)

    @property
    def shape(self) -> torch.Size:
        return self.squares.shape

    def energy(self, r1: int, r2: int, kept: int) -> float:
        last, self._last = self._last, None
        start, carried = 0, None
        if last is not None and r2 == last[1] and r1 >= last[0] and kept <= last[2]:
            start, carried = last[0], last[3]
        del last
        rows = self.squares[:, start:r1, :r2]
        held = 0 if carried is None else carried.numel()
        pool = self.squares.new_empty(held + rows.numel())  # `largest` reorders its buffer
        if carried is not None:
            pool[:held] = carried
        pool[held:].view(rows.shape).copy_(rows)
        del carried  # the previous top-K goes before this one is selected
        top = largest(pool, kept)
        if top.numel() < pool.numel():
            top = top.clone()  # a view of the pool's tail: copied, so the rest of the pool is freed
        del pool
        self._last = (r1, r2, kept, top)
        return float(top.sum())


def _grid(limit: int, points: int) -> list[int]:
    """About `points` ranks from 1 to `limit`: rank 1 too, so a small budget always has a candidate."""
    step = max(1, limit // points)
    return sorted({1, *range(step, limit + 1, step), limit})


def reachable_r1(budget: int, d: int, dh: int) -> int:
    """Largest `r1` at which some core fits `budget` beside the factors: `d r1 + dh < budget`.

    Core rows past it can never be chosen, so the HOSVD need not project them (`hosvd(max_r1=)`).
    """
    return max(1, (budget - dh) // d)


def allocate(
    table: EnergyTable,
    total_energy: float,
    budget: int,
    d: int,
    dh: int,
    grid_points: int = GRID_POINTS,
    ranks: tuple[int, int] | None = None,
    mode2: bool = True,
    dense_core: bool = False,
) -> Allocation:
    """Pick `(r1, r2, K)` with the least predicted error under the budget (§6).

    Candidates come from the one HOSVD core's squares (`table`): a coarse grid over both ranks,
    then every rank pair around the best cell with the step halved each round, one rank at a time
    **[choice]**. `ranks` are the full HOSVD's `(m1, m2)` that span the grid when the core holds
    only the rows up to `reachable_r1` (the candidates beyond fit no core, so the choice is the
    same). Without `mode2` (§17) `r2` is the whole second mode, which costs no factor, and only
    `r1` is searched. With `dense_core` only dense cores are candidates (`K = S r1 r2`, the
    variant `dense_core`, §9): for every `r2`, the largest `r1` whose dense core fits.
    """
    slices, m1, m2 = table.shape
    held = table.shape[1:]
    if ranks is not None:
        m1, m2 = ranks
    if not mode2:
        m2 = held[1]
    if dense_core:
        return _dense_allocation(table, total_energy, budget, d, dh, (m1, m2), mode2)
    best: Allocation | None = None

    def consider(r1: int, r2: int) -> None:
        nonlocal best
        kept = core_capacity(budget, d, dh, slices, r1, r2, mode2)
        if kept <= 0:
            return
        if r1 > held[0] or r2 > held[1]:
            raise ValueError(f"rank ({r1}, {r2}) fits the budget but the core holds only {tuple(held)}")
        err = total_energy - table.energy(r1, r2, kept)
        if best is None or clearly_below(err, best.predicted_error):
            best = Allocation(r1, r2, kept, err)

    rows, cols = _grid(m1, grid_points), _grid(m2, grid_points // 2) if mode2 else [m2]
    for r2 in cols:
        for r1 in rows:
            consider(r1, r2)
    if best is None:
        raise ValueError(f"budget of {budget} values cannot hold even rank-1 factors ({d}+{dh} values)")
    # refine around the best cell, halving the step each round, one rank at a time
    step1, step2 = max(1, m1 // grid_points), max(1, m2 // (grid_points // 2)) if mode2 else 1
    while step1 > 1 or step2 > 1:
        step1, step2 = max(1, step1 // 2), max(1, step2 // 2)
        r1_best, r2_best = best.r1, best.r2
        for r1 in (r1_best - step1, r1_best + step1):
            if 1 <= r1 <= m1:
                consider(r1, r2_best)
        for r2 in (r2_best - step2, r2_best + step2):
            if 1 <= r2 <= m2:
                consider(best.r1, r2)
    return best


def _dense_allocation(table: EnergyTable, total_energy: float, budget: int, d: int, dh: int,
                      ranks: tuple[int, int], mode2: bool) -> Allocation:
    """`allocate` over dense cores only: at each `r2` the largest `r1` that fits (more rows never
    lose energy), the least predicted error of those. Every `r2` is tried: the search is one
    block sum per `r2`, and the optimum sits on the budget's boundary, which a grid would miss."""
    slices, held1, held2 = table.shape
    m1, m2 = min(ranks[0], held1), min(ranks[1], held2)
    best: Allocation | None = None
    for r2 in range(1, m2 + 1) if mode2 else [m2]:
        r1 = min(m1, (budget - (dh * r2 if mode2 else 0)) // (d + slices * r2))
        if r1 < 1:
            continue
        full = slices * r1 * r2
        err = total_energy - table.energy(r1, r2, full)
        if best is None or clearly_below(err, best.predicted_error):
            best = Allocation(r1, r2, full, err)
    if best is None:
        raise ValueError(f"budget of {budget} values cannot hold even rank-1 factors and a dense core")
    return best


def fixed_ranks(budget: int, d: int, dh: int, slices: int, m1: int, m2: int) -> tuple[int, int]:
    """Ablation `fixed_ranks`: the same fraction of `d` and `dh`, largest one whose dense core fits."""
    best = (1, 1)
    for k in range(1, 1001):
        f = k / 1000
        r1, r2 = max(1, min(m1, round(f * d))), max(1, min(m2, round(f * dh)))
        if d * r1 + dh * r2 + r1 * r2 * slices <= budget:
            best = (r1, r2)
    return best


# ---------------------------------------------------------------------------------------------
# §7 gradual pruning with support-constrained refitting


POLAR_MIN_EIGENVALUE = 1e-10
"""Smallest eigenvalue of `M^T M`, relative to the largest, for which `polar` inverts it; below
that (condition of `M` above 1e5, or a zero column from an all-pruned core row) it takes the SVD."""


def polar(m: torch.Tensor) -> torch.Tensor:
    """Orthonormal polar factor `P Q^T` of `M = P S Q^T` (orthogonal Procrustes), `M` tall.

    Computed from the small side: `M (M^T M)^{-1/2}` with `eigh` of the `r x r` Gram in float64,
    one `(d, r) @ (r, r)` product instead of an SVD of `M`. An ill-conditioned or rank-deficient
    `M` (where any orthonormal completion is optimal) falls back to the SVD.
    """
    wide = m.to(WORK_DTYPE)
    values, vectors = torch.linalg.eigh(wide.T @ wide)
    if values[0] <= POLAR_MIN_EIGENVALUE * values[-1].clamp_min(torch.finfo(WORK_DTYPE).tiny):
        p, _, qh = torch.linalg.svd(wide, full_matrices=False)
        return (p @ qh).to(m.dtype)
    inverse_root = (vectors * values.rsqrt()) @ vectors.T
    del values, vectors  # r x r: not resident beside the d x r product
    return (wide @ inverse_root).to(m.dtype)


def refit(
    tensor: torch.Tensor, u1: torch.Tensor, u2: torch.Tensor | None, mask: torch.Tensor, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Alternate the two Procrustes factor updates and the exact core on the support (§7).

    Each update is optimal given the others, so the error never increases. Every product is taken
    a few slices at a time (`_core_pass`, `_u2_target`): the Procrustes targets are sums over
    slices, `sum_s B_s U2 G_s^T` and `sum_s B_s^T U1 G_s`, and the first one reuses the `B_s U2`
    of the core it is formed with, so one pass costs the same products as whole-tensor GEMMs
    without their two tensor-sized float64 temporaries (a 7B-shaped layer's Q/K/V peak,
    benchmarks/results/memory.md).
    """
    slices, r1, r2 = mask.shape
    core = tensor.new_empty(slices, r1, r2)
    u1_target = _core_pass(tensor, u1, u2, mask, core, iterations > 0)
    for i in range(iterations):
        u1, u1_target = polar(u1_target), None  # the d x r1 target freed before the next pass forms its own
        if u2 is not None:  # the identity (§17) is not refitted
            u2 = polar(_u2_target(tensor, u1, core))
        u1_target = _core_pass(tensor, u1, u2, mask, core, i < iterations - 1)
    return u1, u2, core


def _core_pass(tensor: torch.Tensor, u1: torch.Tensor, u2: torch.Tensor | None, mask: torch.Tensor,
               core: torch.Tensor, with_target: bool) -> torch.Tensor | None:
    """Write the exact core on the support, `G_s = U1^T B_s U2` masked, into `core`; with
    `with_target`, also return the `U1` Procrustes target `sum_s B_s U2 G_s^T` (d x r1) of that core."""
    d, r1 = u1.shape
    target = tensor.new_zeros(d, r1) if with_target else None
    for part, tu2, block in projected_slices(tensor, u1, u2):
        core[part] = block.mul_(mask[part])
        if target is not None:
            target.addmm_(tu2.reshape(-1, d).T, core[part].mT.reshape(-1, r1))
    return target


def _u2_target(tensor: torch.Tensor, u1: torch.Tensor, core: torch.Tensor) -> torch.Tensor:
    """The `U2` Procrustes target `sum_s B_s^T U1 G_s` (dh x r2), a few slices at a time."""
    dh, r2 = tensor.shape[2], core.shape[2]
    target = tensor.new_zeros(dh, r2)
    for start in range(0, tensor.shape[0], GRAM_SLICES):
        tu1 = u1.T @ tensor[start : start + GRAM_SLICES]  # (g, r1, dh): U1^T B_s
        target.addmm_(tu1.reshape(-1, dh).T, core[start : start + GRAM_SLICES].reshape(-1, r2))
    return target


def prune_refit(
    tensor: torch.Tensor,
    u1: torch.Tensor,
    u2: torch.Tensor,
    kept: int,
    steps: int = PRUNE_STEPS,
    refits: int = REFITS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the dense core at the chosen ranks down to `kept` entries on a geometric schedule (§7).

    Returns `(U1, U2, G, mask)`. If the gradual path ends worse than the one-shot top-K core it
    started from (refitted on its own support), that one is returned instead, so the result is
    never worse than the allocator's prediction.

    One candidate is resident at a time: the one-shot one is refitted first, only its error kept,
    and refitted again (the same computation, the same result) in the rare case it wins. Side by
    side they held a core and two factors more at the end; the refit's own Procrustes step is
    still the higher peak (34 MB less on a 7B-shaped Q/K/V tensor at keep 0.7,
    benchmarks/results/memory.md).
    """
    core = project_core(tensor, u1, u2)
    total = core.numel()
    if kept >= total:
        mask = torch.ones_like(core, dtype=torch.bool)
        return (*refit(tensor, u1, u2, mask, refits), mask)
    schedule = [max(kept, round(total * (kept / total) ** (t / steps))) for t in range(1, steps + 1)]
    oneshot_mask, mask = top_k_mask(core, kept), top_k_mask(core, schedule[0])
    del core  # every refit builds its own

    def oneshot() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        # the one-shot candidate only has to bound the result by the allocator's prediction: a single
        # refit pass already does (it never increases the error), the rest would rarely change the pick
        return refit(tensor, u1, u2, oneshot_mask, min(refits, 1))

    o1, o2, ocore = oneshot()
    bound = tucker_error(tensor, o1, ocore, o2)
    del o1, o2, ocore
    g1, g2, core = refit(tensor, u1, u2, mask, refits)
    for kept_t in schedule[1:]:
        mask = top_k_mask(core, kept_t)
        del core  # spent: the refit builds its own
        g1, g2, core = refit(tensor, g1, g2, mask, refits)
    if clearly_below(bound, tucker_error(tensor, g1, core, g2)):
        del g1, g2, core, mask
        return (*oneshot(), oneshot_mask)
    return g1, g2, core, mask


# ---------------------------------------------------------------------------------------------
# the whole Q/K/V step


@dataclass(frozen=True)
class TuckerFactors:
    """A compressed joint tensor: `W_s ~= U1_hat G_s U2^T` (§9 layout)."""

    u1: torch.Tensor  # (d, r1), un-whitened
    u2: torch.Tensor | None  # (dh, r2); None: the identity, r2 = dh (§17)
    core: torch.Tensor  # (S, r1, r2), zero off the support, slice norms multiplied back
    mask: torch.Tensor | None  # (S, r1, r2) bool, None for a dense core

    @property
    def stored_values(self) -> int:
        slices, r1, r2 = self.core.shape
        d, dh = self.u1.shape[0], r2 if self.u2 is None else self.u2.shape[0]
        kept = r1 * r2 * slices if self.mask is None else int(self.mask.sum())
        return storage_values(d, dh, slices, r1, r2, kept, self.u2 is not None)

    def weights(self, slices: slice = slice(None), columns: slice = slice(None)) -> torch.Tensor:
        """The reconstructed `(S, d, dh)` tensor, or its block `[slices, :, columns]`."""
        dtype = self.u1.dtype
        if self.u2 is None:
            return self.u1 @ self.core[slices][..., columns].to(dtype)
        return reconstruct(self.u1, self.core[slices].to(dtype), self.u2[columns].to(dtype))


@dataclass(frozen=True)
class TuckerReport:
    r1: int
    r2: int
    kept: int
    eps: float | None
    error_allocated: float
    """Relative squared error of the balanced whitened tensor after allocation (HOSVD + top-K)."""
    error_refit: float
    """The same after gradual pruning and refitting."""


def whiten_and_balance(
    tensor: torch.Tensor, whitening: Whitening, balance: bool, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sqrt(w_s) R^T B_s / ||R^T B_s||_F` and the divisor of every slice (§3-§4), in float64.

    `weights` (one per slice, 1 if None) multiply each slice's share of the objective: a slice
    weighted `w` counts as `w` copies of itself (FTC's key slices, §4). The divisor is the slice's
    norm (1 without balancing) over `sqrt(w_s)`; multiplying a slice's core by it undoes both.
    Whitening runs a few slices at a time, so the only full-size copy is the result. Float64 because
    the factorisations that follow choose ranks and supports among near-ties (§16). The whitening's
    factor is released at the end (`Whitening.release`): every caller factorises the result next
    (HOSVD and refits, CP's ALS, the survey's HOSVD) and needs the factor again, if at all, only to
    map `U1` or `A` back; at width 4096 it is 134 MB beside their peaks.
    """
    slices = tensor.shape[0]
    balanced = torch.empty(tensor.shape, dtype=WORK_DTYPE, device=tensor.device)
    norms = (torch.ones(slices, dtype=WORK_DTYPE, device=tensor.device) if weights is None
             else weights.to(dtype=WORK_DTYPE, device=tensor.device).rsqrt())
    for start in range(0, slices, GRAM_SLICES):
        chunk = tensor[start : start + GRAM_SLICES].to(WORK_DTYPE)
        white = whitening.apply(chunk.transpose(0, 1)).transpose(0, 1)
        if balance:
            norms[start : start + GRAM_SLICES] *= slice_norms(white)
        balanced[start : start + GRAM_SLICES] = white / norms[start : start + GRAM_SLICES, None, None]
    whitening.release()
    return balanced, norms


def compress_tensor(
    tensor: torch.Tensor,
    whitening: Whitening,
    budget: int,
    *,
    balance: bool = True,
    coupled: bool = True,
    steps: int = PRUNE_STEPS,
    refits: int = REFITS,
    weights: torch.Tensor | None = None,
    mode2: bool = True,
    dense_core: bool = False,
) -> tuple[TuckerFactors, TuckerReport]:
    """Whiten, balance, allocate, prune and refit, then undo balancing and whitening (§3-§7).

    `tensor` is `(S, d, dh)` in `(in, out)` layout per slice; `budget` counts stored values;
    `weights` weigh the slices' shares of the objective (`whiten_and_balance`). Without `mode2` the
    second factor is the identity: one shared input factor and a sparse core (§17). With
    `dense_core` the core is kept dense (`allocate`), so the runtime holds what is stored (§9).
    """
    slices, d, dh = tensor.shape
    balanced, norms = whiten_and_balance(tensor, whitening, balance, weights)
    total = squared_norm(balanced)
    ranks = hosvd_ranks(balanced)
    u1, u2, core = hosvd(balanced, reachable_r1(budget, d, dh), mode2)
    if coupled:
        alloc = allocate(EnergyTable(core, owned=True), total, budget, d, dh, ranks=ranks, mode2=mode2,
                         dense_core=dense_core)  # squares it
    else:
        r1, r2 = fixed_ranks(budget, d, dh, slices, *ranks)
        dense = r1 * r2 * slices
        alloc = Allocation(r1, r2, dense, total - float(core[:, :r1, :r2].pow(2).sum()))
    del core
    # copies of the chosen columns, so the unchosen ones are freed before the refits
    u1, u2 = u1[:, : alloc.r1].clone(), None if u2 is None else u2[:, : alloc.r2].clone()
    u1, u2, core, mask = prune_refit(balanced, u1, u2, alloc.kept, steps, refits)
    refit_error = tucker_error(balanced, u1, core, u2)
    dense = bool(mask.all())
    factors = TuckerFactors(
        u1=whitening.unapply(u1.to(WORK_DTYPE)),
        u2=u2,
        core=core * norms[:, None, None],
        mask=None if dense else mask,
    )
    report = TuckerReport(
        alloc.r1, alloc.r2, alloc.kept, whitening.eps, alloc.predicted_error / total, refit_error / total
    )
    return factors, report

"""Activation-induced metrics (ftc-method.md §3): Gram accumulation, damping and the whitening guard.

For a linear map `y = x @ W` and calibration inputs `X (n x d)`, the output error of a perturbation
`dW` is `||X dW||_F^2 = n * ||R^T dW||_F^2` with `C = X^T X / n = R R^T`. Whitening by `R^T` turns
every activation-weighted objective below into a plain Frobenius one.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

WORK_DTYPE = torch.float64
"""Precision of every factorisation and of every step that decides a rank or a support (HOSVD,
top-K selection, refits, truncated SVDs, CP's ALS): LAPACK's results move with the thread count
(float32 `eigh` by up to 0.25 in a vector entry on SmolLM2-shaped Grams, float64 by about 1e-13),
and a discrete choice made on float32 values flips between builds (ftc-method.md §16)."""

DEFAULT_EPS = 1e-4
"""Starting damping of the guard, relative to `mean(diag(C))` (§3)."""
MAX_EPS = 1.0
"""Damping at which the guard gives up and the layer falls back to the identity metric (§3)."""
GUARD_TOLERANCE = 0.01
"""Relative excess over the unwhitened fit's error that the guard still accepts (§3): the damping
itself may cost a whitened fit a little in the undamped metric; instability costs far more."""


PRODUCT_DTYPE = torch.float32
"""Precision of the activation products: the activations themselves are float32 at best."""
CHUNK_ROWS = 2048
"""Rows per float32 product before it is added into a float64 sum: bounds the float32
accumulation error (~sqrt(rows) * 6e-8 relative) far below the guard's damping of 1e-4."""


_SPILL = contextvars.ContextVar("ftc_spill_grams", default=False)
_SPILLED: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
"""The file mappings of the spilled Grams (`gram_buffer`), each here while a tensor (the Gram or a
view of it) holds it."""
_EVICT = getattr(mmap, "MADV_PAGEOUT", getattr(mmap, "MADV_DONTNEED", None))
"""`madvise` advice that takes a mapping's pages out of the process: `MADV_PAGEOUT` (Linux 5.4)
writes them back to their file and reclaims them; `MADV_DONTNEED` unmaps them, the page cache
keeping them until written back. A later read faults them in again, the same bits."""


@contextlib.contextmanager
def spilled_grams(enabled: bool = True) -> Iterator[None]:
    """Within the block, `gram_buffer` backs each `d x d` float64 Gram by a temporary file, and
    `evict_spilled` moves the pages of every live one out of resident memory.

    Why: on a model streamed from disk a layer's Grams (134 MB each at width 4096) sit beside the
    factorisations that follow them but are not read during them: the Q/K/V input Gram waits
    through the HOSVD and the refits for the guard's error and for mapping `U1` back, the `W_O`
    metric through its solve and truncated SVD, which work with its Cholesky factor (§3, §8).
    Spilled during those, they leave the 7B-shaped memory peak (benchmarks/results/memory.md) for
    a write and a read back each, from the temporary folder (`TMPDIR`, which must be a disk, not a
    RAM-backed tmpfs, for this to free memory).
    """
    token = _SPILL.set(enabled and _EVICT is not None)
    try:
        yield
    finally:
        _SPILL.reset(token)


def spilling() -> bool:
    """Whether `gram_buffer` spills here (within `spilled_grams`, where `madvise` exists)."""
    return _SPILL.get()


def gram_buffer(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed `dim x dim` float64 buffer for a Gram: file-backed under `spilled_grams` on the CPU
    (an unlinked temporary file, mapped shared, so its pages can leave memory and come back),
    ordinary memory otherwise. The values and every result computed from them are the same."""
    nbytes = dim * dim * WORK_DTYPE.itemsize
    if not spilling() or torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(dim, dim, dtype=WORK_DTYPE, device=device)
    try:
        with tempfile.TemporaryFile() as file:
            # blocks reserved now (zeros): a full disk fails here, not in a later write-back of the map
            os.posix_fallocate(file.fileno(), 0, nbytes)
            mapped = mmap.mmap(file.fileno(), nbytes)  # the mapping outlives the descriptor
    except OSError:  # no room or no writable TMPDIR: the Gram stays in memory, as unspilled
        return torch.zeros(dim, dim, dtype=WORK_DTYPE, device=device)
    buffer = torch.frombuffer(mapped, dtype=WORK_DTYPE).view(dim, dim)  # holds `mapped` while it lives
    _SPILLED.add(mapped)
    return buffer


def evict_spilled() -> None:
    """Take every live spilled Gram out of resident memory until it is next read (`spilled_grams`).

    Called where a fit stops reading its metric (`Whitening.release`); a Gram read again later
    faults its pages back in from the file, so an eviction is never wrong, at worst a re-read.
    """
    for mapped in list(_SPILLED):
        mapped.madvise(_EVICT)


def pivot_signs(vectors: torch.Tensor) -> torch.Tensor:
    """One sign per column: that of the column's largest-magnitude entry (ftc-method.md §16).

    An eigen- or singular vector is defined up to its sign, and LAPACK's choice can change with the
    thread count; multiplying each column by this makes that entry positive, so the stored factors,
    not only their products, are the same on every build. A sign flip is exact: nothing else moves.
    """
    pivot = vectors.gather(0, vectors.abs().argmax(0, keepdim=True))[0]
    return torch.where(pivot < 0, -1.0, 1.0).to(vectors.dtype)


WHOLE_SPECTRUM_WIDTH = 1024
"""Widest symmetric matrix whose eigenproblem `top_eigenpairs` solves whole (`syevd`), for speed:
every Gram of SmolLM2-135M and Gemma-3-270M (576 and 640 wide). Its workspace of twice the matrix
is 16 MB here, but 64 MB at TinyLlama's 2048 and 268 MB at a 7B model's 4096, where the subset
solver keeps the compression within the memory bounds of benchmarks/results/memory.md."""


def top_eigenpairs(gram: torch.Tensor, count: int, owned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest eigenvalues of a symmetric matrix and their eigenvectors, largest first,
    in float64 on the matrix's device (signs as LAPACK leaves them: see `pivot_signs`).

    On the CPU through SciPy's LAPACK, given a buffer it may overwrite (`owned`: the caller's
    float64 `gram` is then destroyed). Up to `WHOLE_SPECTRUM_WIDTH`, divide and conquer (`syevd`)
    solves the whole spectrum: 2-3.5x faster than the subset solver at the counts the HOSVD and the
    truncations ask for (a third to all of the vectors; 0.04 against 0.11 s at width 576, two
    threads), and its workspace of twice the matrix is at most 16 MB there. Wider, `syevr` for
    the subset only: it computes no other vector and holds about half the matrix beside it, where
    `syevd` holds twice it and torch's `eigh` 4.3 times it (at a 7B-shaped layer that set the memory
    peak of the Q/K/V and `W_O` steps, benchmarks/results/memory.md). Every driver's vectors move
    by about 1e-13 with the thread count (§16 absorbs that). On other devices, torch's `eigh`.
    """
    count = min(count, gram.shape[0])
    if gram.device.type != "cpu":
        values, vectors = torch.linalg.eigh(gram.to(WORK_DTYPE))
        return values[-count:].flip(0), vectors[:, -count:].flip(1)
    import scipy.linalg

    wide = gram.detach().to(WORK_DTYPE)
    if not owned and wide.data_ptr() == gram.data_ptr():
        wide = wide.clone()
    size = wide.shape[0]
    # the transpose of a C-ordered symmetric matrix is the same matrix in the Fortran order LAPACK
    # works in, so `overwrite_a` works in place instead of on a copy; its upper triangle is the
    # C-ordered lower one, the triangle torch's `eigh` reads
    whole = size <= WHOLE_SPECTRUM_WIDTH
    values, vectors = scipy.linalg.eigh(wide.numpy().T, lower=False, overwrite_a=True, check_finite=False,
                                        driver="evd" if whole else "evr",
                                        subset_by_index=None if whole else (size - count, size - 1))
    return torch.from_numpy(values[::-1][:count].copy()), torch.from_numpy(vectors[:, ::-1][:, :count].copy())


def row_chunks(x: torch.Tensor, dim: int) -> Iterator[torch.Tensor]:
    """The rows of `x` in the pieces its float32 products are taken over: each sequence of a
    `(sequences, positions, dim)` batch on its own (cut every `CHUNK_ROWS` positions), any other
    shape every `CHUNK_ROWS` rows.

    Pieces never straddle two sequences, so the same sequences give the same float32 products in
    the same order whatever the batch size (2 or 4 sequences per forward): the float64 sums, and
    every choice made from them, do not depend on how the calibration set was batched.
    """
    if x.dim() == 3:
        for sequence in x:
            yield from sequence.split(CHUNK_ROWS)
    else:
        yield from x.reshape(-1, dim).split(CHUNK_ROWS)


def accumulate_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`total += a^T b` over rows: float32 products per piece of `row_chunks`, summed into `total` (float64).

    A float32 GEMM is several times faster than a float64 one, and the rounding it adds is
    orders of magnitude below both the calibration noise and the damping of the metric.
    """
    dim_a, dim_b = total.shape
    for a_rows, b_rows in zip(row_chunks(a, dim_a), row_chunks(b, dim_b), strict=True):
        a_rows = a_rows.to(device=total.device, dtype=PRODUCT_DTYPE)
        b_rows = b_rows.to(device=total.device, dtype=PRODUCT_DTYPE)
        total += a_rows.T @ b_rows


GRAM_BLOCKS = 4
"""Column blocks of a Gram accumulation: only the blocks on and above the diagonal are multiplied,
(k + 1) / 2k of the full product's work (0.64x of its time measured at width 576, float32)."""


def _blocks(dim: int) -> list[tuple[int, int]]:
    """`(start, stop)` of each of the `GRAM_BLOCKS` column blocks of a `dim`-wide Gram."""
    width = -(-dim // GRAM_BLOCKS)
    return [(start, min(start + width, dim)) for start in range(0, dim, width)]


def accumulate_gram(total: torch.Tensor, rows: torch.Tensor) -> None:
    """`total += rows^T rows` on the blocks on and above the diagonal only (`mirror_upper` fills
    the rest once the sum is complete): a Gram is symmetric, so the blocks below are redundant.

    Float32 products per piece of `row_chunks` (`rows` may be a batch of sequences), summed into
    float64, as `accumulate_product`.
    """
    blocks = _blocks(total.shape[0])
    for chunk in row_chunks(rows, total.shape[0]):
        chunk = chunk.to(device=total.device, dtype=PRODUCT_DTYPE)
        for start, stop in blocks:
            total[start:stop, start:] += chunk[:, start:stop].T @ chunk[:, start:]


def mirror_upper(total: torch.Tensor) -> None:
    """Copy the blocks above the diagonal of an `accumulate_gram` sum onto those below, in place."""
    for start, stop in _blocks(total.shape[0]):
        total[start:stop, :start].copy_(total[:start, start:stop].T)


@dataclass
class Moments:
    """Running first/second moments of row vectors, accumulated batch by batch into float64.

    Keeps `X^T X`, the row count and, when `absolute` (ASVD's statistic), `sum |x|`, so that the
    whole calibration set never has to sit in memory at once (the Gram is d x d, whatever n is).
    `gram_sum` holds only the blocks on and above the diagonal (`accumulate_gram`) until `gram`
    is first read; read the Gram through `gram`.

    With `first_weight` w > 1, batches of shape `(sequences, positions, d)` count the row at the
    first position of each sequence w times (in the sums and in `count`): FTC's weight on the
    attention sink (ftc-method.md §3). Two-dimensional batches carry no positions and count once.
    """

    dim: int
    device: torch.device | str = "cpu"
    absolute: bool = False
    first_weight: int = 1
    gram_sum: torch.Tensor = field(init=False)
    abs_sum: torch.Tensor | None = field(init=False)
    count: int = field(default=0, init=False)
    normalised: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.gram_sum = gram_buffer(self.dim, self.device)
        self.abs_sum = torch.zeros(self.dim, dtype=WORK_DTYPE, device=self.device) if self.absolute else None

    def update(self, x: torch.Tensor) -> None:
        """Add a batch: `(sequences, positions, dim)`, or rows `(..., dim)` without positions.

        Sequence by sequence, each one's sink row right after it, so the float64 sums add the same
        terms in the same order however the sequences were batched (ftc-method.md §16).
        """
        if self.normalised:
            raise RuntimeError("Moments.update after .gram was read: the sum has been normalised in place")
        for sequence in x if x.dim() == 3 else (x.reshape(-1, self.dim),):
            accumulate_gram(self.gram_sum, sequence)
            if self.abs_sum is not None:
                self.abs_sum += sequence.abs().sum(0, dtype=WORK_DTYPE).to(self.abs_sum.device)
            self.count += sequence.shape[0]
            if self.first_weight > 1 and x.dim() == 3:
                self._add_sink(sequence[:1], self.first_weight - 1)

    def _add_sink(self, rows: torch.Tensor, times: int) -> None:
        """Count each of `rows` (a sequence's first position) `times` more times, its product taken
        in float64 (exact for float32 inputs)."""
        wide = rows.to(device=self.gram_sum.device, dtype=WORK_DTYPE)
        self.gram_sum.addmm_(wide.T, wide, alpha=times)  # the whole product: `mirror_upper` reads the upper half
        if self.abs_sum is not None:
            self.abs_sum += wide.abs().sum(0) * times
        self.count += rows.shape[0] * times

    @property
    def gram(self) -> torch.Tensor:
        """`C = X^T X / n`, normalised in place on first use: no second d x d float64 copy (134 MB
        at width 4096). The statistics are complete by then; the result must not be modified."""
        if not self.normalised:
            mirror_upper(self.gram_sum)
            self.gram_sum /= max(self.count, 1)
            self.normalised = True
        return self.gram_sum

    @property
    def abs_mean(self) -> torch.Tensor:
        """Per-channel mean |x| (ASVD's activation statistic)."""
        if self.abs_sum is None:
            raise ValueError("these moments were gathered without absolute sums; create them with absolute=True")
        return self.abs_sum / max(self.count, 1)


def relative_error(err: torch.Tensor, energy: torch.Tensor, balance: bool, weights: torch.Tensor | None = None
                   ) -> float:
    """`sum_s a_s err_s / sum_s a_s energy_s` over slices: the objective of §4 from each slice's
    error and energy in the activation metric.

    `a_s = w_s / energy_s` with slice balancing (every slice's relative error counts `w_s` times),
    `a_s = w_s` without; `w_s` are the slice weights (1 if None; FTC's key slices, §4).
    """
    share = 1.0 / energy.clamp_min(torch.finfo(energy.dtype).tiny) if balance else torch.ones_like(energy)
    if weights is not None:
        share = share * weights.to(share)
    return float((share * err).sum() / (share * energy).sum())


ERROR_SLICES = 8
"""Slices of a stack measured at a time by `ActivationError`."""
ERROR_COLUMNS = 512
"""Columns measured at a time by `ActivationError`: with `ERROR_SLICES`, its float64 temporaries are
this small, never the whole tensor (five copies of it in the one-shot form: 1 GB at width 4096)."""

Approximation = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | Callable[[slice, slice], torch.Tensor]


class ActivationError:
    """Relative activation-weighted error of approximations of one matrix or stack of slices:
    `sum_s a_s tr(dW_s^T C dW_s) / sum_s a_s tr(W_s^T C W_s)` (§3, §4; `relative_error` gives `a_s`).

    `w` is one matrix `(in, out)` or a stack `(S, in, out)`; `C` is `gram`, or the identity if None.
    An approximation is a tensor of `w`'s shape, the factors `(A, B)` of one matrix, or a function
    returning the approximated block `[slices, :, columns]` (a factorisation reconstructed a block at
    a time). Everything is measured a block of `ERROR_SLICES` x `ERROR_COLUMNS` at a time, and the
    slice energies `tr(W_s^T C W_s)` once, at the first call: a guard measures several fits of the
    same weights.
    """

    def __init__(self, w: torch.Tensor, gram: torch.Tensor | None, balance: bool = False,
                 weights: torch.Tensor | None = None) -> None:
        self.w = w if w.dim() == 3 else w[None]
        self.gram = None if gram is None else gram.to(WORK_DTYPE)
        self.balance, self.weights = balance, weights
        self.energy: torch.Tensor | None = None

    def _metric(self, block: torch.Tensor) -> torch.Tensor:
        """`tr(B_s^T C B_s)` of every slice of a block."""
        if self.gram is None:
            return block.pow(2).sum((1, 2))
        return (block * torch.matmul(self.gram, block)).sum((1, 2))

    def _supplier(self, approx: Approximation) -> Callable[[slice, slice], torch.Tensor]:
        if callable(approx):
            return approx
        if isinstance(approx, tuple):
            left, right = approx[0].to(WORK_DTYPE), approx[1]
            return lambda slices, columns: (left @ right[:, columns].to(WORK_DTYPE))[None]
        whole = approx.reshape(self.w.shape)
        return lambda slices, columns: whole[slices, :, columns]

    def __call__(self, approx: Approximation) -> float:
        supply = self._supplier(approx)
        slices, _, width = self.w.shape
        err = torch.zeros(slices, dtype=WORK_DTYPE, device=self.w.device)
        energy = torch.zeros_like(err) if self.energy is None else self.energy
        for start in range(0, slices, ERROR_SLICES):
            rows = slice(start, start + ERROR_SLICES)
            for first in range(0, width, ERROR_COLUMNS):
                columns = slice(first, first + ERROR_COLUMNS)
                part = self.w[rows, :, columns].to(WORK_DTYPE)
                if self.energy is None:
                    energy[rows] += self._metric(part)
                err[rows] += self._metric(part - supply(rows, columns).to(WORK_DTYPE))
        self.energy = energy
        return relative_error(err, energy, self.balance, self.weights)


def damp(gram: torch.Tensor, eps: float) -> torch.Tensor:
    """`C + eps * mean(diag(C)) * I` (§3). A zero Gram is damped by `eps` alone."""
    scale = gram.diagonal().mean().clamp_min(torch.finfo(WORK_DTYPE).tiny)
    damped = gram.clone()  # one copy; an identity matrix would be a second d x d float64 one
    damped.diagonal().add_(eps * scale)
    return damped


def damped_factor(gram: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`R` with `damp(C, eps) = R R^T`, or None where the factorisation fails or is not finite (§3).

    Factorised in place: one d x d float64 buffer, not the damped copy and its factor. A function of
    `C` and `eps` alone, so factorising again gives the same bits (`Whitening.release`). Spilled
    Grams leave memory once it is formed (`evict_spilled`): what follows works with the factor (a
    whitening, `W_O`'s solve beside its right side and solution), and reads `C` again only later.
    """
    damped = damp(gram.to(WORK_DTYPE), eps)
    info = torch.empty((), dtype=torch.int32, device=gram.device)
    chol, info = torch.linalg.cholesky_ex(damped, out=(damped, info))
    evict_spilled()
    if int(info) == 0 and bool(torch.isfinite(chol).all()):
        return chol
    return None


def damped_whitenings(
    gram: torch.Tensor, eps: float | None = None, max_eps: float | None = None
) -> Iterator[Whitening]:
    """The whitening of `damp(C, eps)` for `eps`, `10 eps`, ... up to `max_eps` (§3).

    Damping levels whose factorisation fails or is not finite are skipped; the consumer stops
    at the first level whose *outcome* it accepts (`Whitening.from_gram`, `guarded_fit`). Each
    whitening holds the only reference to its factor, so `release` frees it while the generator
    waits. `eps` and `max_eps` default to `DEFAULT_EPS` and `MAX_EPS` as they are when called.
    """
    eps = DEFAULT_EPS if eps is None else eps
    max_eps = MAX_EPS if max_eps is None else max_eps
    while eps <= max_eps * (1 + 1e-9):
        chol = damped_factor(gram, eps)
        if chol is not None:
            whitening = Whitening(chol, eps, gram)
            del chol
            yield whitening
        eps *= 10.0


T = TypeVar("T")


def guarded_fit(
    gram: torch.Tensor | None,
    fit: Callable[[Whitening], T],
    error: Callable[[T], float],
    reference: Callable[[], float],
    eps: float | None = None,
    max_eps: float | None = None,
) -> tuple[T, Whitening]:
    """Fit in the whitened metric, raising `eps` tenfold while the outcome is unstable (§3).

    Unstable means a non-finite result, or an error (`error`, measured in the undamped activation
    metric) above `reference`, the error of an unwhitened fit: whitening exists to lower that
    error, so a whitened fit that does worse has been spoiled by the conditioning of `C`. A
    condition-number bound cannot detect this: for a PSD Gram the damped one is at most
    `d / eps + 1`. Past `max_eps` the identity metric is used (`eps` is then None).
    """
    identity = Whitening(None, None)
    if gram is None:
        return fit(identity), identity
    # first, while no factor or whitened fit is resident: at width 4096 the reference's SVD
    # beside a Cholesky factor would set the W_O step's memory peak (benchmarks/results/memory.md)
    bound = reference()
    for whitening in damped_whitenings(gram, eps, max_eps):
        result = fit(whitening)
        # the error is measured in the Gram's metric, not the factor's: freed before it (and before
        # the next level's factor is formed)
        whitening.release()
        measured = error(result)
        if math.isfinite(measured) and (not math.isfinite(bound) or measured <= bound * (1 + GUARD_TOLERANCE)):
            return result, whitening
    return fit(identity), identity


class Whitening:
    """The mode-1 change of basis `W~ = R^T W` and its inverse `U1_hat = R^{-T} U1`, with
    `damp(C, eps) = R R^T` (§3); the identity where `chol` is None.

    A whitening formed from a Gram (`gram`) may `release` its factor between uses: the next use
    factorises `damp(C, eps)` again, to the same bits (`damped_factor`). A fit whitens its tensor,
    then factorises and refits it for most of its time and maps `U1` back only at the end; without
    the release the factor is resident throughout, 134 MB at width 4096 beside a 7B-shaped Q/K/V
    refit's or `W_O` SVD's peak (benchmarks/results/memory.md), for one more Cholesky factorisation.
    """

    def __init__(self, chol: torch.Tensor | None, eps: float | None, gram: torch.Tensor | None = None) -> None:
        self._chol, self.eps, self._gram = chol, eps, gram

    @classmethod
    def from_gram(cls, gram: torch.Tensor | None, eps: float | None = None) -> Whitening:
        """The least-damped finite whitening of `gram` (the identity if `gram` is None or none is)."""
        if gram is None:
            return cls(None, None)
        return next(damped_whitenings(gram, eps), cls(None, None))

    @property
    def chol(self) -> torch.Tensor | None:
        if self._chol is None and self._gram is not None and self.eps is not None:
            self._chol = damped_factor(self._gram, self.eps)
            if self._chol is None:  # formed once from the same Gram: never the identity in silence
                raise RuntimeError(f"the Cholesky factor of the Gram damped by eps={self.eps} failed when formed "
                                   "again; was the Gram modified after the whitening was formed?")
        return self._chol

    def release(self) -> None:
        """Free the factor until the next use (kept where it was not formed from a Gram), and spill
        the Grams (`evict_spilled`): a fit releases its whitening once its operand is whitened, so
        neither the factor nor its Gram is resident during the factorisation that follows."""
        if self._gram is not None:
            self._chol = None
        evict_spilled()

    def apply(self, w: torch.Tensor) -> torch.Tensor:
        """`R^T W` for `W` of shape `(d, ...)`."""
        if self.chol is None:
            return w
        return torch.tensordot(self.chol.T.to(w.dtype), w, dims=1)

    def apply_by_columns(self, w: torch.Tensor, block: int = 512) -> torch.Tensor:
        """`R^T W` in `WORK_DTYPE` for a matrix `W` of any float dtype, `block` columns at a time:
        no `WORK_DTYPE` copy of the whole `W` beside the result and the factor (134 MB each at
        4096 x 4096, which set the layer list's peak on a 7B shape, `benchmarks/results/memory.md`)."""
        white = torch.empty(w.shape, dtype=WORK_DTYPE, device=w.device)
        for start in range(0, w.shape[1], block):
            white[:, start : start + block] = self.apply(w[:, start : start + block].to(WORK_DTYPE))
        return white

    def unapply(self, u: torch.Tensor) -> torch.Tensor:
        """`R^{-T} U` for `U` of shape `(d, r)`: maps a whitened left factor back."""
        if self.chol is None:
            return u
        return torch.linalg.solve_triangular(self.chol.T.to(u.dtype), u, upper=True)

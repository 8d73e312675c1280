"""The fast forms of the Tucker and metric numerics against the textbook forms they replace.

Each test computes one quantity both ways: the way the method text defines it (full SVDs,
batched products summed over slices, float64 Grams) and the way the library computes it.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from ftc.numerics.lowrank import weighted_error
from ftc.numerics.metric import (
    ActivationError,
    Moments,
    Whitening,
    damp,
    damped_whitenings,
    spilled_grams,
)
from ftc.numerics.tucker import (
    EnergyTable,
    TuckerFactors,
    allocate,
    core_capacity,
    hosvd,
    hosvd_ranks,
    mode1_unfold,
    mode2_unfold,
    polar,
    project_core,
    reachable_r1,
    refit,
    times_right,
    top_k_mask,
    whiten_and_balance,
)
from tests.support.tensors import structured_tensor

D = torch.float64


def _projector(u: torch.Tensor, rank: int) -> torch.Tensor:
    return u[:, :rank] @ u[:, :rank].T


def test_eigh_hosvd_spans_the_svd_hosvd_subspaces_at_every_rank():
    t = structured_tensor()
    u1, u2, core = hosvd(t)
    s1 = torch.linalg.svd(mode1_unfold(t), full_matrices=False)
    s2 = torch.linalg.svd(mode2_unfold(t), full_matrices=False)
    assert u1.shape == s1.U.shape and u2.shape == s2.U.shape
    for r in (1, 5, 12, 30, 40):
        torch.testing.assert_close(_projector(u1, r), _projector(s1.U, r))
    for r in (1, 3, 8):
        torch.testing.assert_close(_projector(u2, r), _projector(s2.U, r))
    # the core's mode energies are the squared singular values, largest first
    torch.testing.assert_close(core.pow(2).sum((0, 2)), s1.S.pow(2))
    torch.testing.assert_close(core.pow(2).sum((0, 1)), s2.S.pow(2))


def test_project_core_is_the_definition():
    t = structured_tensor()
    g = torch.Generator().manual_seed(1)
    u1 = torch.linalg.qr(torch.randn(40, 9, dtype=D, generator=g))[0]
    u2 = torch.linalg.qr(torch.randn(8, 5, dtype=D, generator=g))[0]
    torch.testing.assert_close(project_core(t, u1, u2), u1.T @ t @ u2)


@pytest.mark.parametrize("mode2", [True, False])
def test_a_core_written_over_its_tensor_is_the_definition(mode2):
    """`into_tensor` (the layer list's survey, §15): the core lands in the spent tensor's own buffer,
    its values those of a fresh core, whatever the slice count against `GRAM_SLICES` and with the
    narrower `U2` of an MLP-like tensor (`dh > S d`)."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(19, 4, 30, dtype=D, generator=g)
    u1 = torch.linalg.qr(torch.randn(4, 3, dtype=D, generator=g))[0]
    u2 = torch.linalg.qr(torch.randn(30, 12, dtype=D, generator=g))[0] if mode2 else None
    expected = u1.T @ t @ (u2 if mode2 else torch.eye(30, dtype=D))
    core = project_core(t, u1, u2, into_tensor=True)
    assert core.data_ptr() == t.data_ptr()
    torch.testing.assert_close(core, expected, rtol=1e-12, atol=1e-12)


def _polar_svd(m: torch.Tensor) -> torch.Tensor:
    p, _, qh = torch.linalg.svd(m, full_matrices=False)
    return p @ qh


def test_polar_from_the_small_side_equals_the_svd_polar_factor():
    g = torch.Generator().manual_seed(2)
    for rows, cols, dtype in [(50, 7, D), (300, 40, torch.float32)]:
        m = torch.randn(rows, cols, dtype=dtype, generator=g) * torch.logspace(0, -2, cols, dtype=dtype)
        p = polar(m)
        assert p.dtype == dtype
        torch.testing.assert_close(p, _polar_svd(m), rtol=1e-4, atol=1e-5)


def test_polar_of_a_rank_deficient_matrix_is_still_orthonormal():
    m = torch.randn(30, 6, dtype=D, generator=torch.Generator().manual_seed(3))
    m[:, 2] = 0  # a core row pruned away entirely gives such a column
    p = polar(m)
    torch.testing.assert_close(p.T @ p, torch.eye(6, dtype=D))
    torch.testing.assert_close(p.T @ m, (p.T @ m).T)  # P^T M symmetric PSD: the polar condition


def _refit_batched(t, u1, u2, mask, iterations):
    """The text's form: per-slice products summed over the slice mode, full-SVD Procrustes."""
    core = mask * (u1.T @ t @ u2)
    for _ in range(iterations):
        u1 = _polar_svd((t @ u2 @ core.transpose(1, 2)).sum(0))
        u2 = _polar_svd((t.transpose(1, 2) @ u1 @ core).sum(0))
        core = mask * (u1.T @ t @ u2)
    return u1, u2, core


def test_slice_chunked_refit_equals_the_batched_sum_form():
    t = structured_tensor(slices=19)  # more than GRAM_SLICES: the sums run over three chunks
    u1, u2, _ = hosvd(t)
    u1, u2 = u1[:, :10], u2[:, :5]
    mask = top_k_mask(project_core(t, u1, u2), 400)
    fast = refit(t, u1, u2, mask, 3)
    slow = _refit_batched(t, u1, u2, mask, 3)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_whitening_equals_the_whole_tensor_form():
    t = structured_tensor(slices=19)
    x = torch.randn(200, 40, dtype=D, generator=torch.Generator().manual_seed(4)) * torch.linspace(3, 0.1, 40,
                                                                                                     dtype=D)
    white = Whitening.from_gram(x.T @ x / 200)
    whole = white.apply(t.transpose(0, 1)).transpose(0, 1)
    norms = whole.flatten(1).norm(dim=1)
    balanced, got = whiten_and_balance(t, white, balance=True)
    torch.testing.assert_close(got, norms)
    torch.testing.assert_close(balanced, whole / norms[:, None, None])
    unbalanced, ones = whiten_and_balance(t, white, balance=False)
    torch.testing.assert_close(ones, torch.ones(19, dtype=D))
    torch.testing.assert_close(unbalanced, whole)


def test_hosvd_up_to_the_reachable_rank_is_the_leading_block_and_allocates_the_same():
    t = structured_tensor(slices=6, d=40, dh=8)
    total = float(t.pow(2).sum())
    u1, _, core = hosvd(t)
    for budget in (400, 700, 1100):
        cap = reachable_r1(budget, 40, 8)
        assert core_capacity(budget, 40, 8, 6, cap + 1, 1) <= 0 < core_capacity(budget, 40, 8, 6, cap, 1)
        capped_u1, _, capped = hosvd(t, cap)
        assert capped_u1.shape == (40, cap) and capped.shape == (6, cap, 8)
        torch.testing.assert_close(capped_u1, u1[:, :cap])
        torch.testing.assert_close(capped, core[:, :cap])
        full = allocate(EnergyTable(core), total, budget, 40, 8)
        found = allocate(EnergyTable(capped), total, budget, 40, 8, ranks=hosvd_ranks(t))
        # the same choice; the capped eigenvectors are computed as a subset (`top_eigenpairs`), so
        # their last bits may differ from the full set's
        assert (found.r1, found.r2, found.kept) == (full.r1, full.r2, full.kept)
        assert found.predicted_error == pytest.approx(full.predicted_error, rel=1e-12)


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("metric", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_blockwise_reconstruction_error_equals_the_whole_tensor_weighted_error(balance, metric, weighted):
    g = torch.Generator().manual_seed(6)
    t = structured_tensor(slices=19).float()  # float32, the storage precision of a compressed layer
    x = torch.randn(300, 40, dtype=D, generator=g) * torch.linspace(3, 0.1, 40, dtype=D)
    gram = x.T @ x / 300 if metric else None
    weights = torch.linspace(1, 5, 19, dtype=D) if weighted else None
    u1, u2, _ = hosvd(t.double())
    for r1, r2 in ((6, 3), (12, 5)):
        core = project_core(t.double(), u1[:, :r1], u2[:, :r2]).float()
        factors = TuckerFactors(u1[:, :r1], u2[:, :r2].float(), core, None)
        expected = weighted_error(t, factors.weights(), gram, balance, weights)
        measure = ActivationError(t, gram, balance, weights)
        assert measure(factors.weights) == pytest.approx(expected, rel=1e-12)
        assert measure(factors.weights) == pytest.approx(expected, rel=1e-12)  # slice energies reused


def test_in_place_damped_factors_equal_the_cholesky_of_the_damped_gram():
    x = torch.randn(30, 40, dtype=D, generator=torch.Generator().manual_seed(7))
    gram = x.T @ x / 30  # rank 30 of 40: the least damping already factorises, every level does
    levels = list(damped_whitenings(gram, 1e-4, 1e-2))
    assert [level.eps for level in levels] == pytest.approx([1e-4, 1e-3, 1e-2])
    for level in levels:
        torch.testing.assert_close(level.chol, torch.linalg.cholesky(damp(gram, level.eps)), rtol=0, atol=0)


def test_a_released_factor_is_freed_and_formed_again_to_the_same_bits():
    x = torch.randn(200, 40, dtype=D, generator=torch.Generator().manual_seed(8))
    white = Whitening.from_gram(x.T @ x / 200)
    first = white.chol.clone()
    held = weakref.ref(white.chol)
    white.release()
    assert held() is None  # nothing else (the generator that formed it) keeps the buffer alive
    assert torch.equal(white.chol, first)
    identity = Whitening(None, None)
    identity.release()
    assert identity.chol is None


@pytest.mark.parametrize("dim", [48, 50, 3])  # whole, ragged and single-column Gram blocks
def test_float32_chunk_grams_equal_float64_grams(dim):
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(3, 700, dim, generator=g) * torch.logspace(1, -2, dim) + 0.3 for _ in range(3)]
    moments = Moments(dim, absolute=True)
    for b in batches:
        moments.update(b)
    rows = torch.cat([b.reshape(-1, dim) for b in batches]).to(D)
    assert moments.gram_sum.dtype == D and moments.count == rows.shape[0]
    torch.testing.assert_close(moments.gram, rows.T @ rows / rows.shape[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moments.abs_mean, rows.abs().mean(0), rtol=1e-6, atol=1e-7)
    # normalised in place once: a second read gives the same Gram, a late update is refused
    torch.testing.assert_close(moments.gram, rows.T @ rows / rows.shape[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="normalised"):
        moments.update(batches[0])


def test_blockwise_16bit_linear_equals_the_float32_linear(monkeypatch):
    import ftc.models.weights

    monkeypatch.setattr(ftc.models.weights, "UPCAST_ROWS", 7)  # several blocks and a ragged last one
    g = torch.Generator().manual_seed(6)
    linear = torch.nn.Linear(24, 30)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(30, 24, generator=g))
    reference = torch.nn.functional.linear
    x = torch.randn(2, 5, 24, generator=g)
    for dtype in (torch.float16, torch.bfloat16):
        half = linear.weight.detach().to(dtype)
        linear.weight = torch.nn.Parameter(half, requires_grad=False)
        linear.__class__ = ftc.models.weights.BlockwiseLinear
        torch.testing.assert_close(linear(x), reference(x, half.float(), linear.bias), rtol=1e-6, atol=1e-6)
        assert linear.weight.dtype == dtype
        # the gradient of the input, as the loss metric's backward pass takes it, with no float32 copy
        # of the weight kept for it (only the 16-bit weight itself is saved)
        leaf, saved = x.clone().requires_grad_(), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = linear(leaf)
        upstream = torch.randn(out.shape, generator=g)
        (got,) = torch.autograd.grad(out, leaf, upstream)
        torch.testing.assert_close(got, upstream @ half.float(), rtol=1e-6, atol=1e-6)
        assert saved and all(t.dtype == dtype for t in saved)


def test_a_factor_that_cannot_be_formed_again_is_an_error_not_the_identity():
    x = torch.randn(200, 6, dtype=D, generator=torch.Generator().manual_seed(9))
    gram = x.T @ x / 200
    white = Whitening.from_gram(gram)
    white.release()
    gram.fill_(float("nan"))  # the Gram the whitening was formed from, modified after
    with pytest.raises(RuntimeError, match="modified"):
        white.apply(torch.ones(6, 2, dtype=D))


def _resident_kib(tensor: torch.Tensor) -> int:
    """Resident KiB of the mapping that holds `tensor`'s data, from /proc/self/smaps (Linux)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads resident pages from Linux's /proc")
def test_spilled_grams_leave_resident_memory_while_unread_and_read_back_the_same():
    """Under `spilled_grams` a Gram lives in a file mapping; forming a factor and releasing a
    whitening (a fit that has whitened its operand) evict it, and reading it again gives the same
    bits (ftc-method.md §3)."""
    x = torch.randn(3, 400, 512, generator=torch.Generator().manual_seed(10))
    with spilled_grams():
        spilled = Moments(512)
        spilled.update(x)
        gram = spilled.gram
        assert _resident_kib(gram) >= 512 * 512 * 8 // 1024  # touched: every page resident
        white = Whitening.from_gram(gram)
        assert _resident_kib(gram) < 64  # out of memory once its factor is formed, until read
        copy = gram.clone()  # read: faulted back in
        assert _resident_kib(gram) >= 512 * 512 * 8 // 1024
        white.release()
        assert _resident_kib(gram) < 64
    with spilled_grams(False):
        plain = Moments(512)
    plain.update(x)
    assert torch.equal(gram, plain.gram) and torch.equal(copy, gram)  # the sums of ordinary memory, bit for bit
    assert torch.equal(white.chol, Whitening.from_gram(plain.gram).chol)
    assert _resident_kib(plain.gram) >= 512 * 512 * 8 // 1024  # ordinary memory is not evicted
    Whitening(None, None).release()
    assert _resident_kib(plain.gram) >= 512 * 512 * 8 // 1024


def test_a_gram_that_cannot_be_spilled_stays_in_memory(tmp_path, monkeypatch):
    """No writable temporary folder: the Gram is ordinary memory and the run goes on."""
    import tempfile

    from ftc.numerics.metric import gram_buffer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    with spilled_grams():
        buffer = gram_buffer(8)
    assert torch.equal(buffer, torch.zeros(8, 8, dtype=D))
    buffer.add_(1.0)  # writable


def test_times_right_is_each_slice_times_the_matrix_in_its_precision():
    """`loss_metric`'s head metric on the Q/K/V tensor (§5): slice by slice `B_s R` in float64, rounded once
    to the tensor's dtype; 11 slices, so the last group of `GRAM_SLICES` is a ragged one."""
    g = torch.Generator().manual_seed(12)
    tensor = torch.randn(11, 9, 5, generator=g)
    right = torch.randn(5, 5, generator=g, dtype=torch.float64)
    want = torch.stack([(tensor[s].double() @ right).float() for s in range(11)])
    got = times_right(tensor, right)
    assert got.dtype == tensor.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)

"""Tucker compression of the joint tensor against its definitions (ftc-method.md §2, §4-§7)."""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch

from ftc.numerics import tucker
from ftc.numerics.metric import Whitening
from ftc.numerics.tucker import (
    EnergyTable,
    allocate,
    compress_tensor,
    core_capacity,
    head_concat,
    hosvd,
    largest,
    project_core,
    prune_refit,
    reconstruct,
    refit,
    storage_values,
    top_k_mask,
    tucker_error,
)
from tests.support.tensors import structured_tensor

D = torch.float64


def test_head_concat_orders_slices_and_inverts():
    d, dh = 10, 4
    wq, wk, wv = torch.randn(d, 3 * dh), torch.randn(d, dh), torch.randn(d, dh)
    t = head_concat(wq, wk, wv, dh)
    assert t.shape == (5, d, dh)
    torch.testing.assert_close(t[1], wq[:, dh : 2 * dh])
    torch.testing.assert_close(t[3], wk)
    torch.testing.assert_close(t[4], wv)
    assert head_concat(wq, wk, wv, dh, kv_repeat=3).shape == (9, d, dh)


def test_hosvd_is_orthonormal_nested_and_exact():
    t = structured_tensor()
    u1, u2, core = hosvd(t)
    torch.testing.assert_close(u1.T @ u1, torch.eye(u1.shape[1], dtype=D))
    torch.testing.assert_close(u2.T @ u2, torch.eye(u2.shape[1], dtype=D))
    torch.testing.assert_close(reconstruct(u1, core, u2), t)
    r1, r2 = 9, 5
    truncated = reconstruct(u1[:, :r1], core[:, :r1, :r2], u2[:, :r2])
    torch.testing.assert_close((t - truncated).pow(2).sum(), t.pow(2).sum() - core[:, :r1, :r2].pow(2).sum())


def test_allocators_predicted_error_equals_the_measured_truncation_error():
    t = structured_tensor()
    total = float(t.pow(2).sum())
    u1, u2, core = hosvd(t)
    budget = int(0.3 * t.numel())
    alloc = allocate(EnergyTable(core), total, budget, t.shape[1], t.shape[2])
    g = core[:, : alloc.r1, : alloc.r2]
    mask = top_k_mask(g, alloc.kept)
    approx = reconstruct(u1[:, : alloc.r1], g * mask, u2[:, : alloc.r2])
    assert (t - approx).pow(2).sum().item() == pytest.approx(alloc.predicted_error, rel=1e-9)
    assert storage_values(t.shape[1], t.shape[2], t.shape[0], alloc.r1, alloc.r2, alloc.kept) <= budget


def test_top_k_mask_is_the_stable_sorts_support_ties_to_the_lower_index():
    """The selection gives the support of a stable descending sort of the tie keys (§16): every
    magnitude above the cut, then equal ones by index, whatever the size of the tie at the cut."""
    generator = torch.Generator().manual_seed(5)
    cores = [torch.randn(3, 20, 7, dtype=D, generator=generator),
             torch.randint(-3, 4, (3, 20, 7), generator=generator).to(D)]  # many exact ties, signs too
    near = cores[0].clone()
    near[1, 2, 3] = near[0, 0, 0] * (1 + 1e-12)  # a near-tie: equal up to the tolerance
    cores.append(near)
    for core in cores:
        keys = torch.round(core.abs().flatten() / (core.abs().max() * 1e-9))
        order = torch.sort(keys, descending=True, stable=True).indices
        for kept in (1, 2, 37, 200, core.numel() - 1, core.numel()):
            expected = torch.zeros(core.numel(), dtype=torch.bool)
            expected[order[:kept]] = True
            mask = top_k_mask(core, kept)
            assert torch.equal(mask.flatten(), expected), kept
            assert int(mask.sum()) == kept


def test_largest_holds_the_top_k_values_in_the_buffers_own_tail():
    values = torch.randint(0, 9, (300,), generator=torch.Generator().manual_seed(2)).to(D)  # ties too
    for count in (0, 1, 17, 299, 300, 400):
        buffer = values.clone()
        top = largest(buffer, count)
        expected = torch.sort(values, descending=True).values[:count]
        assert torch.equal(torch.sort(top, descending=True).values, expected)
        assert top.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view: no copy


def test_energy_table_matches_the_top_k_definition():
    core = hosvd(structured_tensor())[2]
    table = EnergyTable(core)  # one table for every r2: the carried top-K is used only where it is valid
    for r2 in (2, 5, 8):
        # in the grid's order (r1 up, K down: selected from the previous top-K and the new rows),
        # against it, repeated, and past the block's size
        for r1, kept in [(3, 10), (20, 111), (40, 10_000), (10, 200), (25, 150), (30, 40), (30, 40), (36, 5),
                         (12, 60)]:
            # the definition: the `kept` largest squared entries of G[:, :r1, :r2]
            block = core[:, :r1, :r2].pow(2).flatten()
            retained = float(torch.topk(block, min(kept, block.numel())).values.sum())
            assert table.energy(r1, r2, kept) == pytest.approx(retained, rel=1e-12)


def test_core_capacity_fills_but_never_exceeds_the_budget():
    for budget in (500, 900, 2000, 5000):
        for r1, r2 in [(5, 3), (10, 8), (30, 8)]:
            kept = core_capacity(budget, 40, 8, 7, r1, r2)
            if kept > 0:
                assert storage_values(40, 8, 7, r1, r2, kept) <= budget
                assert kept == r1 * r2 * 7 or storage_values(40, 8, 7, r1, r2, kept + 1) > budget


def test_refit_never_increases_the_error_on_a_fixed_support():
    t = structured_tensor()
    u1, u2, _core = hosvd(t)
    u1, u2 = u1[:, :8], u2[:, :5]
    mask = top_k_mask(project_core(t, u1, u2), 120)
    errors = [tucker_error(t, u1, mask * project_core(t, u1, u2), u2)]
    for _ in range(5):
        u1, u2, g = refit(t, u1, u2, mask, 1)
        errors.append(tucker_error(t, u1, g, u2))
        torch.testing.assert_close(u1.T @ u1, torch.eye(8, dtype=D))
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(errors))


def test_prune_refit_ends_no_worse_than_the_allocation_and_respects_k():
    t = structured_tensor()
    total = float(t.pow(2).sum())
    u1, u2, core = hosvd(t)
    alloc = allocate(EnergyTable(core), total, int(0.25 * t.numel()), t.shape[1], t.shape[2])
    f1, f2, g, mask = prune_refit(t, u1[:, : alloc.r1], u2[:, : alloc.r2], alloc.kept)
    assert int(mask.sum()) == alloc.kept
    assert bool((g[~mask] == 0).all())
    assert tucker_error(t, f1, g, f2) <= alloc.predicted_error + 1e-9


@pytest.mark.parametrize("balance", [True, False])
def test_error_falls_as_the_keep_ratio_rises(balance):
    t = structured_tensor(slices=9, d=48, dh=8)
    x = torch.randn(300, 48, dtype=D) * torch.linspace(2, 0.1, 48, dtype=D)
    white = Whitening.from_gram(x.T @ x / 300)
    errors = []
    for rho in (0.1, 0.2, 0.4, 0.6, 0.8):
        factors, report = compress_tensor(t, white, int(rho * t.numel()), balance=balance)
        assert factors.stored_values <= int(rho * t.numel())
        assert report.error_refit <= report.error_allocated + 1e-12
        errors.append(report.error_refit)
    assert all(b < a for a, b in itertools.pairwise(errors))


def test_the_whitening_factor_is_not_resident_during_the_refits_and_the_fit_is_unchanged(monkeypatch):
    """The fit releases the Cholesky factor after whitening and forms it again to map `U1` back
    (ftc-method.md §3): the same factors to the bit as a fit handed a factor it cannot release."""
    t = structured_tensor(slices=9, d=48, dh=8)
    x = torch.randn(300, 48, dtype=D, generator=torch.Generator().manual_seed(4)) * torch.linspace(2, 0.1, 48, dtype=D)
    white = Whitening.from_gram(x.T @ x / 300)
    pinned = Whitening(white.chol.clone(), white.eps)  # no Gram: `release` keeps it
    held, resident = [], []
    real = tucker.prune_refit

    def watched(*args, **kwargs):
        resident.append(held[-1]() is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(tucker, "prune_refit", watched)
    held.append(weakref.ref(white.chol))
    factors, _ = compress_tensor(t, white, int(0.3 * t.numel()))
    held.append(weakref.ref(pinned.chol))
    expected, _ = compress_tensor(t, pinned, int(0.3 * t.numel()))
    assert resident == [False, True]  # the watch itself sees a factor held
    for name in ("u1", "u2", "core"):
        assert torch.equal(getattr(factors, name), getattr(expected, name)), name


def test_exact_low_rank_structure_is_recovered():
    g = torch.Generator().manual_seed(3)
    u1 = torch.linalg.qr(torch.randn(30, 4, dtype=D, generator=g))[0]
    u2 = torch.linalg.qr(torch.randn(8, 3, dtype=D, generator=g))[0]
    t = reconstruct(u1, torch.randn(6, 4, 3, dtype=D, generator=g), u2)
    factors, report = compress_tensor(t, Whitening(None, None), 30 * 4 + 8 * 3 + 6 * 12, balance=False)
    assert report.error_refit < 1e-6  # float32 factor updates
    torch.testing.assert_close(factors.weights().double(), t, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode2", [True, False])
def test_dense_core_allocation_is_the_best_dense_core_under_the_budget(mode2):
    """`allocate(dense_core=True)` against its definition: of every `(r1, r2)` whose dense core fits
    beside the factors, the one with the most retained energy (a brute force over all of them)."""
    t = structured_tensor()
    slices, d, dh = t.shape
    total = float(t.pow(2).sum())
    core = hosvd(t)[2]
    for fraction in (0.1, 0.3, 0.6):
        budget = int(fraction * t.numel())
        alloc = allocate(EnergyTable(core), total, budget, d, dh, mode2=mode2, dense_core=True)
        assert alloc.kept == slices * alloc.r1 * alloc.r2
        assert storage_values(d, dh, slices, alloc.r1, alloc.r2, alloc.kept, mode2) <= budget
        fits = [(r1, r2) for r1 in range(1, core.shape[1] + 1) for r2 in (range(1, dh + 1) if mode2 else [dh])
                if storage_values(d, dh, slices, r1, r2, slices * r1 * r2, mode2) <= budget]
        best = max(float(core[:, :r1, :r2].pow(2).sum()) for r1, r2 in fits)
        assert total - alloc.predicted_error == pytest.approx(best, rel=1e-12)


def test_a_dense_core_fit_stores_no_mask_and_costs_what_a_sparse_one_may_not_exceed():
    """The variant `dense_core` (§9): no support mask, the stored values within the budget, and an
    error no lower than the sparse core's at the same budget (which may choose a dense core too)."""
    t = structured_tensor(slices=9, d=48, dh=8)
    budget = int(0.3 * t.numel())
    dense, dense_report = compress_tensor(t, Whitening(None, None), budget, dense_core=True)
    sparse, sparse_report = compress_tensor(t, Whitening(None, None), budget)
    assert dense.mask is None and sparse.mask is not None
    assert dense.stored_values <= budget
    assert dense_report.kept == dense.core.numel()
    assert dense_report.error_allocated >= sparse_report.error_allocated - 1e-12

"""The same inputs give the same artifact on any thread count and any batching (ftc-method.md §16).

LAPACK's results move with the thread count (float32 `eigh` by up to 0.25 in a vector entry at
width 576, float64 by about 1e-13), and float32 products taken over different row blocks round
differently; a rank or a support chosen among near-ties then flips, and later layers, whose
statistics come from the compressed ones, follow. These tests compress with 1 and 2 threads and
with 2 and 4 sequences per forward and require the same discrete choices and the same tensors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ftc.compression.methods import make_method
from ftc.models.arch import layout_of
from ftc.numerics.metric import Moments, Whitening
from ftc.numerics.tucker import compress_tensor
from tests.support.pipeline import compress_model
from tests.support.tiny import LAYOUTS, tiny_model

CALIB = torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(3))


@contextlib.contextmanager
def threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_gram_sums_do_not_depend_on_how_the_sequences_were_batched():
    """Bitwise: the float32 products are taken per sequence, so 1, 2 or 4 sequences per update add
    the same products in the same order (the sink rows in float64, exact)."""
    x = torch.randn(4, 300, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(0, -2, 48)
    grams = []
    for batch in (1, 2, 4):
        moments = Moments(48, "cpu", absolute=True, first_weight=32)
        for start in range(0, 4, batch):
            moments.update(x[start : start + batch])
        grams.append(moments.gram)
    assert all(torch.equal(grams[0], g) for g in grams[1:])


def test_a_large_tucker_fit_makes_the_same_choices_on_one_and_two_threads():
    """A SmolLM2-shaped Q/K/V tensor (15 slices of 576 x 64): the ranks, the support and the factors
    agree, where float32 factorisations give other vectors on two threads."""
    g = torch.Generator().manual_seed(0)
    tensor = torch.randn(15, 576, 64, dtype=torch.float64, generator=g) * torch.logspace(0, -2, 64,
                                                                                         dtype=torch.float64)
    x = torch.randn(2048, 576, dtype=torch.float64, generator=g) * torch.logspace(0, -3, 576, dtype=torch.float64)
    white = Whitening.from_gram(x.T @ x / 2048)
    runs = []
    for count in (1, 2):
        with threads(count):
            runs.append(compress_tensor(tensor, white, int(0.3 * tensor.numel()), steps=3))
    (a, report_a), (b, report_b) = runs
    assert (report_a.r1, report_a.r2, report_a.kept) == (report_b.r1, report_b.r2, report_b.kept)
    assert torch.equal(a.mask, b.mask)
    for x_a, x_b in ((a.u1, b.u1), (a.u2, b.u2), (a.core, b.core)):
        torch.testing.assert_close(x_a, x_b, rtol=0, atol=1e-9)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_family_compresses_alike_on_any_threads_and_batching(layout):
    """The same ranks, supports, budgets and errors, tensors within 1e-5 (stored in float32)."""
    runs = []
    for count, batch in ((1, 2), (2, 4)):
        model = tiny_model(layout)
        with threads(count):
            result = compress_model(model, layout_of(model.config), make_method("ftc", 0.4, torch.float32), CALIB,
                                    device=torch.device("cpu"), batch_size=batch)
        runs.append(result.layers)
    for first, second in zip(*runs, strict=True):
        assert [spec for spec, _ in first.groups] == [spec for spec, _ in second.groups]
        for key in ("r1", "r2", "K", "r_o", "eps", "eps_o", "budget_values"):
            assert first.report[key] == second.report[key], key
        assert first.report["error_refit"] == pytest.approx(second.report["error_refit"], rel=1e-9)
        for (_, one), (_, two) in zip(first.groups, second.groups, strict=True):
            for name, tensor in one.items():
                if name == "core_mask":
                    assert torch.equal(tensor, two[name])
                else:
                    torch.testing.assert_close(tensor, two[name], rtol=0, atol=1e-5)

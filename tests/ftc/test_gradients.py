"""The loss gradient's Grams of `wo_loss_metric` (ftc.compression.gradients, ftc-method.md §8) against
their definition, computed another way: a zero offset added to each `W_O` output is a leaf whose
gradient is `g_t` of every position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftc.compression.gradients import loss_gradient_grams
from ftc.models.arch import decoder_layers, get_module, layout_of
from tests.support.tiny import tiny_model

IDS = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(4))


def _by_offsets(model, layout) -> list[torch.Tensor]:
    layers = decoder_layers(model, layout)
    grams = [torch.zeros(layout.hidden, layout.hidden, dtype=torch.float64) for _ in layers]
    for sequence in IDS:
        offsets = [torch.zeros(1, sequence.shape[0], layout.hidden, requires_grad=True) for _ in layers]
        handles = [get_module(layer, layout.o).register_forward_hook(lambda _m, _a, out, d=d: out + d)
                   for layer, d in zip(layers, offsets, strict=True)]
        try:
            logits = model(input_ids=sequence[None], use_cache=False).logits[0, :-1]
            grads = torch.autograd.grad(F.cross_entropy(logits, sequence[1:], reduction="sum"), offsets)
        finally:
            for handle in handles:
                handle.remove()
        for gram, grad in zip(grams, grads, strict=True):
            rows = grad[0].to(torch.float64)
            gram += rows.T @ rows
    return grams


@pytest.mark.parametrize("family", ["gqa", "gemma3"])
def test_loss_gradient_grams_are_the_definition_and_leave_the_model_as_it_was(family):
    model = tiny_model(family, layers=2)
    layout = layout_of(model.config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    got = loss_gradient_grams(model, layout, IDS, torch.device("cpu"), progress=False)
    want = _by_offsets(model, layout)
    assert len(got) == 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7 * float(w.diagonal().mean()))
        assert float(w.diagonal().mean()) > 0
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)

"""The loss gradient's Grams of `wo_loss_metric` and `loss_metric` (ftc.compression.gradients,
ftc-method.md §5, §8) against their definition, computed another way: a zero offset added to each
projection's output is a leaf whose gradient is `g_t` of every position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftc.compression.gradients import loss_gradient_grams, shared_head_metric
from ftc.models.arch import decoder_layers, get_module, layout_of
from ftc.models.weights import ModuleSource
from tests.support.tiny import tiny_model

IDS = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(4))


def _by_offsets(model, layout) -> list[dict[str, torch.Tensor]]:
    """Per layer, the Gram of the gradient at `W_O`'s output and, per head slice, at Q/K/V's outputs
    (their gradients side by side in q, k, v order, a fused module's once)."""
    layers = decoder_layers(model, layout)
    names = list(dict.fromkeys((layout.o, layout.q, layout.k, layout.v)))
    grams = [{"o": torch.zeros(layout.hidden, layout.hidden, dtype=torch.float64),
              "qkv": torch.zeros(layout.slices, layout.head_dim, layout.head_dim, dtype=torch.float64)}
             for _ in layers]
    for sequence in IDS:
        offsets, handles = [], []
        for layer in layers:
            for name in names:
                module = get_module(layer, name)
                offset = torch.zeros(1, sequence.shape[0], module.weight.shape[0], requires_grad=True)
                handles.append(module.register_forward_hook(lambda _m, _a, out, d=offset: out + d))
                offsets.append(offset)
        try:
            logits = model(input_ids=sequence[None], use_cache=False).logits[0, :-1]
            grads = torch.autograd.grad(F.cross_entropy(logits, sequence[1:], reduction="sum"), offsets)
        finally:
            for handle in handles:
                handle.remove()
        for index, gram in enumerate(grams):
            rows = [grad[0].to(torch.float64) for grad in grads[index * len(names) : (index + 1) * len(names)]]
            gram["o"] += rows[0].T @ rows[0]
            heads = torch.cat(rows[1:], dim=1).reshape(sequence.shape[0], layout.slices, layout.head_dim)
            gram["qkv"] += torch.einsum("tsa,tsb->sab", heads, heads)
    return grams


@pytest.mark.parametrize("family", ["gqa", "gemma3", "phi3"])
def test_loss_gradient_grams_are_the_definition_and_leave_the_model_as_it_was(family):
    model = tiny_model(family, layers=2)
    layout = layout_of(model.config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    got = loss_gradient_grams(ModuleSource(model), layout, IDS, torch.device("cpu"), progress=False, heads=True)
    want = _by_offsets(model, layout)
    assert len(got) == 2
    for g, w in zip(got, want, strict=True):
        for part in ("o", "qkv"):
            scale = float(w[part].diagonal(dim1=-2, dim2=-1).mean())
            torch.testing.assert_close(g[part], w[part], rtol=1e-4, atol=1e-7 * scale)
        assert float(w["o"].diagonal().mean()) > 0
        assert bool((w["qkv"].diagonal(dim1=1, dim2=2).mean(dim=1) > 0).all())
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert "qkv" not in loss_gradient_grams(ModuleSource(model), layout, IDS[:1], torch.device("cpu"),
                                            progress=False)[0]
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=0)


def test_the_shared_head_metric_is_the_mean_of_the_slices_shapes():
    """One `dh x dh` metric for every slice (§5): each slice's Gram at unit mean diagonal, averaged, so
    a slice's scale (FTC's own weights say that) does not move it, and a slice with no gradient is left
    out rather than averaged in as zero."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 30, 6, generator=g, dtype=torch.float64) * torch.logspace(0, 1, 6, dtype=torch.float64)
    per_slice = torch.einsum("sta,stb->sab", rows, rows)
    want = sum(per_slice[s] / (torch.trace(per_slice[s]) / 6) for s in range(4)) / 4
    torch.testing.assert_close(shared_head_metric(per_slice), want)
    scaled = per_slice * torch.tensor([1.0, 1e3, 1e-3, 7.0], dtype=torch.float64)[:, None, None]
    torch.testing.assert_close(shared_head_metric(scaled), want)
    torch.testing.assert_close(shared_head_metric(torch.cat([per_slice, torch.zeros(1, 6, 6, dtype=torch.float64)])),
                               want)


class _Reads:
    """A weight source that records, read by read, which decoder layer each read belongs to (None: the
    embedding, final norm or head), runs of reads of the same one counted once."""

    def __init__(self, wrapped: ModuleSource, layers_path: str) -> None:
        self.wrapped, self.prefix, self.layers = wrapped, layers_path + ".", []
        self.config, self.resident, self.text_part_of = wrapped.config, wrapped.resident, wrapped.text_part_of

    def names(self) -> list[str]:
        return self.wrapped.names()

    def get(self, name: str) -> torch.Tensor:
        index = int(name[len(self.prefix):].partition(".")[0]) if name.startswith(self.prefix) else None
        if not self.layers or self.layers[-1] != index:
            self.layers.append(index)
        return self.wrapped.get(name)

    @property
    def nbytes(self) -> int:
        return self.wrapped.nbytes


def test_the_backward_pass_streams_the_layers_forward_then_back():
    """One decoder layer read at a time (§10): every layer once on the way up, then each once more on
    the way down from the last, the head read between them, so a model that does not fit in memory
    gets its Grams too."""
    model = tiny_model("gemma3", layers=3)
    layout = layout_of(model.config)
    weights = _Reads(ModuleSource(model), layout.layers_path)
    loss_gradient_grams(weights, layout, IDS[:1], torch.device("cpu"), progress=False)
    assert weights.layers == [None, 0, 1, 2, None, 2, 1, 0]

"""The loss gradient's Grams at the attention projections' outputs: the output side of the variants
`wo_loss_metric` and `loss_metric` (ftc-method.md §8, §5).

FTC fits `W_O` in the metric of its input, `tr(dW^T C dW)`, and Q/K/V in their input's metric too:
every direction of a projection's output weighs the same. On Gemma-3-270M that misses what the loss
sees past the post-attention norm, the residual and every later layer (docs/results.md, "A metric
past the output"). The variants weigh an output by `H = sum_t g_t g_t^T`, `g_t` the gradient of the
calibration tokens' next-token loss at that output for token `t` on the original model, and fit in
K-FAC's metric `tr(C dW H dW^T)`:

- `W_O`: the whole `hidden x hidden` Gram at its output (`ftc.numerics.lowrank.guarded_whitened_svd`);
- Q/K/V (`loss_metric` only): their Tucker factor `U2` is shared by every head slice, so the metric
  on the head dimension must be one `dh x dh` matrix for all slices (`shared_head_metric`): the mean
  over slices of each slice's Gram scaled to unit mean diagonal. Each slice's overall weight stays
  FTC's own (slice balancing and the key weight, §4); the loss metric only says which directions
  within a head matter.

One backward pass per calibration sequence through the whole model, which is why this holds the
whole model in memory (as `asvd`'s search does) and is a variant, not the default.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ftc.models.arch import AttentionLayout, decoder_layers, get_module
from ftc.numerics.metric import WORK_DTYPE, accumulate_gram, mirror_upper

if TYPE_CHECKING:
    from .methods import Method


def _head_modules(layout: AttentionLayout) -> list[tuple[str, int]]:
    """The modules whose outputs hold Q, K and V's head slices and how many each holds, in the
    head-concat order (§2): three, or one fused `qkv_proj` whose output is Q heads, K heads, V heads."""
    if layout.fused_qkv:
        return [(layout.fused_qkv, layout.slices)]
    return [(layout.q, layout.heads), (layout.k, layout.kv_heads), (layout.v, layout.kv_heads)]


def loss_gradient_grams(model: nn.Module, layout: AttentionLayout, ids: torch.Tensor, device: torch.device,
                        progress: bool = True, heads: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, `{"o": sum_t g_t g_t^T}` (float64, `hidden x hidden`, `g_t` at `W_O`'s output)
    over every position of `ids`, and with `heads` also `"qkv"`: `(S, dh, dh)`, the same sum for each
    of the `S = Hq + 2 Hkv` head slices of Q/K/V's outputs, in the order of the head-concat tensor.

    `g_t` is the gradient of the summed next-token cross-entropy of the sequence. One sequence per
    backward pass bounds the activations autograd keeps to one sequence's; no parameter gradient is
    formed (each parameter's `requires_grad` is off for the pass and restored after), only the hidden
    states' along the way. The model is left as it was.
    """
    layers = decoder_layers(model, layout)
    dh = layout.head_dim
    grams = [{"o": torch.zeros(layout.hidden, layout.hidden, dtype=WORK_DTYPE, device=device)} for _ in layers]
    if heads:
        for gram in grams:
            gram["qkv"] = torch.zeros(layout.slices, dh, dh, dtype=WORK_DTYPE, device=device)

    def whole(gram: torch.Tensor):
        return lambda grad: accumulate_gram(gram, grad.reshape(-1, grad.shape[-1]))

    def per_head(gram: torch.Tensor):
        def add(grad: torch.Tensor) -> None:
            rows = grad.reshape(-1, gram.shape[0], dh).to(WORK_DTYPE)
            gram.add_(torch.einsum("tsa,tsb->sab", rows, rows))
        return add

    def capture(add):
        def hook(_module, _args, out):
            out.register_hook(add)
        return hook

    handles = []
    for layer, gram in zip(layers, grams, strict=True):
        handles.append(get_module(layer, layout.o).register_forward_hook(capture(whole(gram["o"]))))
        start = 0
        for name, count in _head_modules(layout) if heads else ():
            handles.append(get_module(layer, name).register_forward_hook(
                capture(per_head(gram["qkv"][start : start + count]))))
            start += count
    trained = [p for p in model.parameters() if p.requires_grad]
    for param in trained:
        param.requires_grad_(False)
    embed = model.get_input_embeddings()
    try:
        for sequence in tqdm(ids, desc="loss gradients", unit="seq", disable=not progress):
            sequence = sequence.to(device)
            with torch.no_grad():  # the embedding's own scaling (Gemma) included, as the model applies it
                embedded = embed(sequence[None])
            with torch.enable_grad():
                logits = model(inputs_embeds=embedded.requires_grad_(), use_cache=False,
                               logits_to_keep=torch.arange(sequence.shape[0] - 1, device=device)).logits
                F.cross_entropy(logits[0].float(), sequence[1:], reduction="sum").backward()
            del logits
    finally:
        for handle in handles:
            handle.remove()
        for param in trained:
            param.requires_grad_(True)
    for gram in grams:
        mirror_upper(gram["o"])
    return grams


def shared_head_metric(per_slice: torch.Tensor) -> torch.Tensor:
    """One `dh x dh` metric for every head slice: the mean of the slices' Grams `(S, dh, dh)`, each
    scaled to unit mean diagonal, so that a slice's share is its shape, not its scale (each slice's
    scale is FTC's own weight, §4). A slice with no gradient at all adds nothing."""
    scale = per_slice.diagonal(dim1=1, dim2=2).mean(dim=1)
    live = scale > 0
    if not bool(live.any()):
        return per_slice.sum(dim=0)
    return (per_slice[live] / scale[live, None, None]).mean(dim=0)


def with_loss_metric(method: Method, model: nn.Module, layout: AttentionLayout, ids: torch.Tensor,
                     device: torch.device, progress: bool = True) -> Method:
    """`method` with the loss gradient's Grams (`Method.output_grams`) of `model`, the whole original
    model, on the calibration `ids`: at every `W_O` output, and at Q/K/V's when `method` asks
    (`Method.loss_parts`), reduced to their shared head metric."""
    heads = "qkv" in method.loss_parts
    grams = loss_gradient_grams(model, layout, ids, device, progress, heads=heads)
    if heads:
        grams = [{**gram, "qkv": shared_head_metric(gram["qkv"])} for gram in grams]
    return dataclasses.replace(method, output_grams=tuple(grams))


__all__ = ["loss_gradient_grams", "shared_head_metric", "with_loss_metric"]

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

The backward pass is streamed as the compression is (§10): one decoder layer resident at a time.
A forward pass through the original layers keeps each layer's input in a temporary file; the head
gives the gradient at the last layer's output; then the layers run backward from the last one, each
recomputing its forward from its kept input to turn the gradient at its output into the gradient at
its input, the Grams gathered on the way. The same gradients as one backward pass through the whole
model, which a 7B model could not hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ftc.models.arch import AttentionLayout, decoder_layers, get_module
from ftc.models.weights import WeightSource, materialize, materialize_embedding_rows, release, skeleton
from ftc.numerics.metric import WORK_DTYPE, accumulate_gram, evict_spilled, gram_buffer, mirror_upper
from ftc.runtime.hf.modeling_ftc import trim_heap

from .pipeline import Stream, layer_inputs, map_large_allocations, propagate
from .sensitivity import SpilledTensors, head_modules, logits_from_layer, materialized

if TYPE_CHECKING:
    from .methods import Method


def _slice_modules(layout: AttentionLayout) -> list[tuple[str, int]]:
    """The modules whose outputs hold Q, K and V's head slices and how many each holds, in the
    head-concat order (§2): three, or one fused `qkv_proj` whose output is Q heads, K heads, V heads."""
    if layout.fused_qkv:
        return [(layout.fused_qkv, layout.slices)]
    return [(layout.q, layout.heads), (layout.k, layout.kv_heads), (layout.v, layout.kv_heads)]


def loss_gradient_grams(weights: WeightSource, layout: AttentionLayout, ids: torch.Tensor, device: torch.device,
                        progress: bool = True, heads: bool = False,
                        reduce_heads: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        compute_dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer, `{"o": sum_t g_t g_t^T}` (float64, `hidden x hidden`, `g_t` at `W_O`'s output)
    over every position of `ids`, and with `heads` also `"qkv"`: `(S, dh, dh)`, the same sum for each
    of the `S = Hq + 2 Hkv` head slices of Q/K/V's outputs, in the order of the head-concat tensor
    (`reduce_heads` of it when given, applied as soon as a layer's sum is complete, so only the reduced
    metric of the other layers is held).

    `g_t` is the gradient of the summed next-token cross-entropy of each sequence, on the original
    model streamed from `weights` (see the module's docstring): one sequence per forward and backward,
    which bounds the activations autograd keeps to one sequence's of one layer. Only the hidden states'
    gradients are formed, never a parameter's. The `W_O` Grams are `gram_buffer`s (file-backed under
    `spilled_grams`): a 7B model's are 134 MB a layer.
    """
    bounded = not weights.resident  # streamed from disk: keep host memory low, as `compress_layers` does
    if bounded:
        map_large_allocations()
    model = skeleton(weights.config)
    embed = materialize_embedding_rows(model, weights, ids, device)
    stream = layer_inputs(model, layout, ids, 1, device)
    layers = decoder_layers(model, layout)
    inputs: list[SpilledTensors | None] = []  # each layer's input, a temporary file per layer
    bar = tqdm(total=2 * len(layers) + 1, desc="loss gradients", unit="layer", disable=not progress)
    for index in range(len(layers)):
        name = f"{layout.layers_path}.{index}"
        inputs.append(SpilledTensors(iter(stream.hidden)))
        materialize(model, name, weights, device, compute_dtype)
        propagate(layers[index], stream.at(index))
        release(model, name)
        bar.update()
    with materialized(model, head_modules(model, layout), weights, device, compute_dtype):
        grads = [_head_gradient(model, layout, sequence, h, device)
                 for sequence, h in zip(ids, stream.hidden, strict=True)]
    release(model, embed)
    stream.hidden.clear()  # the last layer's outputs: spent once their gradients are in
    if bounded:
        trim_heap()
    bar.update()
    grams: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    for index in reversed(range(len(layers))):
        name = f"{layout.layers_path}.{index}"
        materialize(model, name, weights, device, compute_dtype)
        grams[index] = _layer_backward(layers[index], layout, stream.at(index), iter(inputs[index]), grads, heads)
        inputs[index] = None  # its file closed
        release(model, name)
        evict_spilled()  # this layer's `W_O` Gram is complete: out of memory until its compression reads it
        if bounded:
            trim_heap()
        if reduce_heads is not None and heads:
            grams[index]["qkv"] = reduce_heads(grams[index]["qkv"])
        bar.update()
    bar.close()
    return grams


def _head_gradient(model: torch.nn.Module, layout: AttentionLayout, sequence: torch.Tensor, hidden: torch.Tensor,
                   device: torch.device) -> torch.Tensor:
    """The gradient of `sequence`'s summed next-token cross-entropy at the last decoder layer's output
    `hidden`, through the model's own final norm and head (and any logit soft-capping)."""
    leaf = hidden.to(device).detach().requires_grad_()
    positions = torch.arange(sequence.shape[0] - 1)
    with torch.enable_grad():
        (_, logits), = logits_from_layer(model, layout, len(decoder_layers(model, layout)), sequence[None], 1,
                                         [leaf], device, positions)
        loss = F.cross_entropy(logits[0].float(), sequence[1:].to(device), reduction="sum")
        (grad,) = torch.autograd.grad(loss, leaf)
    return grad.detach()


def _layer_backward(layer: torch.nn.Module, layout: AttentionLayout, stream: Stream, inputs: Iterator[torch.Tensor],
                    grads: list[torch.Tensor], heads: bool) -> dict[str, torch.Tensor]:
    """`grads` (one per sequence, at the layer's output) turned into the gradients at its input in
    place, recomputing its forward from `inputs`; returns its Grams (see `loss_gradient_grams`)."""
    dh = layout.head_dim
    gram = {"o": gram_buffer(layout.hidden, stream.device)}
    if heads:
        gram["qkv"] = torch.zeros(layout.slices, dh, dh, dtype=WORK_DTYPE, device=stream.device)

    def whole(grad: torch.Tensor) -> None:
        accumulate_gram(gram["o"], grad.reshape(-1, grad.shape[-1]))

    def per_head(part: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def add(grad: torch.Tensor) -> None:
            rows = grad.reshape(-1, part.shape[0], dh).to(WORK_DTYPE)
            part.add_(torch.einsum("tsa,tsb->sab", rows, rows))
        return add

    def capture(add: Callable[[torch.Tensor], None]):
        def hook(_module, _args, out):
            out.register_hook(add)
        return hook

    handles = [get_module(layer, layout.o).register_forward_hook(capture(whole))]
    start = 0
    for name, count in _slice_modules(layout) if heads else ():
        handles.append(get_module(layer, name).register_forward_hook(
            capture(per_head(gram["qkv"][start : start + count]))))
        start += count
    try:
        for b, (kw, h) in enumerate(zip(stream.kwargs, inputs, strict=True)):
            leaf = h.to(stream.device, copy=True).requires_grad_()  # `h` is the file's reused read buffer
            with torch.enable_grad():
                out = layer(leaf, **kw)
                out = out[0] if isinstance(out, tuple) else out
                (grads[b],) = torch.autograd.grad(out, leaf, grads[b])
    finally:
        for handle in handles:
            handle.remove()
    mirror_upper(gram["o"])
    return gram


def shared_head_metric(per_slice: torch.Tensor) -> torch.Tensor:
    """One `dh x dh` metric for every head slice: the mean of the slices' Grams `(S, dh, dh)`, each
    scaled to unit mean diagonal, so that a slice's share is its shape, not its scale (each slice's
    scale is FTC's own weight, §4). A slice with no gradient at all adds nothing."""
    scale = per_slice.diagonal(dim1=1, dim2=2).mean(dim=1)
    live = scale > 0
    if not bool(live.any()):
        return per_slice.sum(dim=0)
    return (per_slice[live] / scale[live, None, None]).mean(dim=0)


def with_loss_metric(method: Method, weights: WeightSource, layout: AttentionLayout, ids: torch.Tensor,
                     device: torch.device, progress: bool = True) -> Method:
    """`method` with the loss gradient's Grams (`Method.output_grams`) of the original model streamed
    from `weights`, on the calibration `ids`: at every `W_O` output, and at Q/K/V's when `method` asks
    (`Method.loss_parts`), reduced to their shared head metric."""
    grams = loss_gradient_grams(weights, layout, ids, device, progress, heads="qkv" in method.loss_parts,
                                reduce_heads=shared_head_metric)
    return dataclasses.replace(method, output_grams=tuple(grams))


__all__ = ["loss_gradient_grams", "shared_head_metric", "with_loss_metric"]

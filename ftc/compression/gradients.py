"""The loss gradient's Gram at every attention output: the output side of `wo_loss_metric` (§8).

FTC truncates `W_O` in the metric of its input, `tr(dW^T C dW)`: every direction of the attention
output weighs the same. On Gemma-3-270M that misses what the loss sees past the post-attention norm,
the residual and every later layer (docs/results.md, "A metric past the output"). The variant
`wo_loss_metric` weighs the output by `H = sum_t g_t g_t^T`, `g_t` the gradient of the calibration
tokens' next-token loss at the `W_O` output of token `t` on the original model, and truncates in
K-FAC's metric `tr(C dW H dW^T)` (`ftc.numerics.lowrank.guarded_whitened_svd`).

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


def loss_gradient_grams(model: nn.Module, layout: AttentionLayout, ids: torch.Tensor, device: torch.device,
                        progress: bool = True) -> list[torch.Tensor]:
    """Per decoder layer, `sum_t g_t g_t^T` (float64, `hidden x hidden`) over every position of `ids`.

    `g_t` is the gradient of the summed next-token cross-entropy of the sequence at the output of the
    layer's `W_O`. One sequence per backward pass bounds the activations autograd keeps to one
    sequence's; no parameter gradient is formed (each parameter's `requires_grad` is off for the
    pass and restored after), only the hidden states' along the way. The model is left as it was.
    """
    layers = decoder_layers(model, layout)
    grams = [torch.zeros(layout.hidden, layout.hidden, dtype=WORK_DTYPE, device=device) for _ in layers]

    def capture(gram: torch.Tensor):
        def hook(_module, _args, out):
            out.register_hook(lambda grad: accumulate_gram(gram, grad.reshape(-1, grad.shape[-1])))
        return hook

    handles = [get_module(layer, layout.o).register_forward_hook(capture(gram))
               for layer, gram in zip(layers, grams, strict=True)]
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
        mirror_upper(gram)
    return grams


def with_loss_metric(method: Method, model: nn.Module, layout: AttentionLayout, ids: torch.Tensor,
                     device: torch.device, progress: bool = True) -> Method:
    """`method` with the loss gradient's Gram at every `W_O` output (`Method.output_grams`) of `model`,
    the whole original model, on the calibration `ids`."""
    return dataclasses.replace(method, output_grams=tuple(loss_gradient_grams(model, layout, ids, device, progress)))


__all__ = ["loss_gradient_grams", "with_loss_metric"]

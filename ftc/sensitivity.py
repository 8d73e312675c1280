"""Budgets from measured sensitivity: ASVD's rank search and the layer list of `--allocation sensitivity`.

ASVD's sensitivity-based truncation-rank search (ftc-method.md §11 `asvd`; Yuan et al. 2023,
STRS): for every attention projection and every candidate parameter ratio `p`, the projection
alone is replaced by its ASVD truncation at rank `floor(p m n / (m + n))` and the model's
perplexity on a few calibration sequences is measured; a perplexity threshold is then searched so
that every matrix takes the smallest `p` whose perplexity stays under it, within the model-wide
budget.

The layer list (§15): for every candidate keep ratio, each layer's attention alone compressed by
the planning method (FTC or CP) and the KL divergence of the model's predictions from the original
ones; one ratio per layer is then chosen for the least summed divergence within the budget.

The loss of the whole model is needed per candidate, so the search holds the whole model in
memory, as ASVD's does. It is cheap where it can be: each decoder layer's input on the
sensitivity sequences is computed once, and a candidate in layer `l` runs only layers `l..L-1`,
the final norm and the head (the model's own forward, with the layers before `l` handing on the
cached hidden state).

Either list depends on the model, the calibration and the method's fixed choices, not on
rho, so it is kept on disk (`cache_folder`) and a second ratio, a resumed run or a sweep over rho
reuses it: the search is paid once per model and calibration, not once per ratio.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .allocation import Curve, choose
from .arch import AttentionLayout, decoder_layers, get_module, projection_weights, set_module
from .artifact import atomic_write_bytes
from .data import ids_sha256
from .lowrank import scaled_svd
from .metric import WORK_DTYPE
from .options import (
    ASVD_RATIO_CANDIDATES,
    ASVD_SENSITIVITY_SEQUENCES,
    ASVD_UNLISTED_RATIO,
    LAYER_RATIO_CANDIDATES,
    InputError,
    method_ratio_problem,
)
from .pipeline import compress_layer, layer_inputs
from .weights import WeightSource, materialize, skeleton

if TYPE_CHECKING:
    from .methods import Method

PARTS = ("q", "k", "v", "o")
CACHE_ENV = "FTC_CACHE_DIR"


@dataclass(frozen=True)
class Sensitivity:
    """The model's loss with one part of it compressed at `ratio`, the rest original: in ASVD's list,
    one matrix (`proj`) truncated and the loss the calibration perplexity; in the layer list of
    `--allocation sensitivity` (§15), one layer's whole attention (`proj` "attention") compressed by
    the planning method and the loss the KL divergence from the original model's predictions."""

    layer: int
    proj: str
    ratio: float
    loss: float


def threshold_ratios(entries: list[Sensitivity], sizes: dict[tuple[int, str], int], budget: int,
                     unlisted: float = ASVD_UNLISTED_RATIO) -> dict[tuple[int, str], float]:
    """ASVD's binary search for a perplexity threshold (§11): the ratio of each matrix within `budget`.

    Entries sorted by perplexity, highest first; the threshold at position `k` admits the entries
    from `k` on, and each matrix takes the smallest ratio it has among them (`unlisted` if none).
    The lower the threshold (the larger `k`), the larger the ratios: the stored values
    `sum int(p m n)` grow with `k`, and the largest `k` within `budget` is the lowest threshold
    that fits. ASVD's own loop ends on the last index it probed, which can overshoot its target by
    one entry; the largest feasible one never does.
    """
    ranked = sorted(entries, key=lambda e: -e.loss)  # stable: ties keep the measuring order

    def plan(start: int) -> dict[tuple[int, str], float]:
        ratios = dict.fromkeys(sizes, unlisted)
        for e in ranked[start:]:
            ratios[e.layer, e.proj] = min(ratios[e.layer, e.proj], e.ratio)
        return ratios

    def cost(ratios: dict[tuple[int, str], float]) -> int:
        return sum(int(ratios[unit] * size) for unit, size in sizes.items())

    if cost(plan(0)) > budget:
        raise InputError(f"the budget of {budget} values is below the cheapest candidates "
                         f"({cost(plan(0))}); raise --ratio to at least {min(e.ratio for e in entries)}")
    low, high = 0, len(ranked)  # plan(low) fits; find the largest start that does
    while low < high:
        mid = (low + high + 1) // 2
        if cost(plan(mid)) <= budget:
            low = mid
        else:
            high = mid - 1
    return plan(low)


def whole_model(weights: WeightSource, device: torch.device, resident: nn.Module | None = None) -> nn.Module:
    """The whole model for the search: `resident` itself when it is the float32 text model the
    weights come from (never a second copy), else every weight materialised from the source,
    16-bit Linear weights kept in their dtype (`weights.materialize`)."""
    float32 = resident is not None and all(p.dtype == torch.float32 for p in resident.parameters()
                                           if p.is_floating_point())
    if float32 and weights.text_part_of is None:
        return resident
    model = skeleton(weights.config)
    materialize(model, "", weights, device, torch.float32)  # a tied head is read from the embedding's name
    return model.to(device)


class _Stop(Exception):
    """Raised once the last decoder layer has run: the statistics passes need no head."""


@contextlib.contextmanager
def _hooks(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def _decoder_pass(model: nn.Module, layout: AttentionLayout, ids: torch.Tensor, batch_size: int,
                  device: torch.device, handles: list) -> None:
    """Run `ids` through the decoder stack batch by batch with `handles`' hooks in place."""
    last = decoder_layers(model, layout)[-1]

    def stop(_module, _args, _out):
        raise _Stop

    with _hooks([*handles, last.register_forward_hook(stop)]):
        for start in range(0, ids.shape[0], batch_size):
            with contextlib.suppress(_Stop):
                model(input_ids=ids[start : start + batch_size].to(device), use_cache=False)


def activation_scales(model: nn.Module, layout: AttentionLayout, ids: torch.Tensor, batch_size: int,
                      device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Per layer, the mean |x| of the Q/K/V input (`"qkv"`) and of the `W_O` input (`"o"`) on the
    original model: the statistic `asvd` scales by, on the same calibration batch as its compression."""
    sums: list[dict[str, tuple]] = []
    handles = []
    for layer in decoder_layers(model, layout):
        sums.append({})
        for part, name in (("qkv", layout.q), ("o", layout.o)):

            def hook(_module, args, into=sums[-1], part=part):
                rows = args[0].reshape(-1, args[0].shape[-1])
                total, count = into.get(part, (0, 0))
                into[part] = (total + rows.abs().sum(0, dtype=WORK_DTYPE), count + rows.shape[0])

            handles.append(get_module(layer, name).register_forward_pre_hook(hook))
    _decoder_pass(model, layout, ids, batch_size, device, handles)
    return [{part: total / count for part, (total, count) in layer.items()} for layer in sums]


def cached_layer_inputs(model: nn.Module, layout: AttentionLayout, ids: torch.Tensor, batch_size: int,
                        device: torch.device) -> list[list[torch.Tensor]]:
    """Per decoder layer, its input hidden state on `ids` (float32, host), one tensor per batch."""
    layers = decoder_layers(model, layout)
    cached: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = []
    for index, layer in enumerate(layers):

        def keep(_module, args, kwargs, into=cached[index]):
            into.append(_hidden(args, kwargs).detach().to("cpu", torch.float32, copy=True))  # never a view

        handles.append(layer.register_forward_pre_hook(keep, with_kwargs=True))
    _decoder_pass(model, layout, ids, batch_size, device, handles)
    return cached


def _logits_from_layer(model: nn.Module, layout: AttentionLayout, start: int, ids: torch.Tensor, batch_size: int,
                       inputs: list[torch.Tensor], device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`(ids, logits)` per batch of `ids`, with layers `0..start-1` replaced by the cached input of
    layer `start` (`inputs`, one per batch): only the rest of the model runs."""
    layers = decoder_layers(model, layout)
    for batch, hidden in zip(range(0, ids.shape[0], batch_size), inputs, strict=True):
        chunk = ids[batch : batch + batch_size].to(device)
        h = hidden.to(device)
        for layer in layers[:start]:
            layer.forward = lambda *args, h=h, **kwargs: h
        try:
            logits = model(input_ids=chunk, use_cache=False).logits
        finally:
            for layer in layers[:start]:
                del layer.forward
        yield chunk, logits


@torch.no_grad()
def loss_from_layer(model: nn.Module, layout: AttentionLayout, start: int, ids: torch.Tensor, batch_size: int,
                    inputs: list[torch.Tensor], device: torch.device) -> float:
    """Mean next-token cross-entropy of the model on `ids`, running from layer `start` on its cached
    input (`_logits_from_layer`)."""
    total, count = 0.0, 0
    for chunk, logits in _logits_from_layer(model, layout, start, ids, batch_size, inputs, device):
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum"))
        count += chunk[:, 1:].numel()
        del logits
    return total / count


@torch.no_grad()
def divergence_from_layer(model: nn.Module, layout: AttentionLayout, start: int, ids: torch.Tensor, batch_size: int,
                          inputs: list[torch.Tensor], reference: list[torch.Tensor], device: torch.device) -> float:
    """Mean KL divergence per token of the model's next-token distribution from `reference` (the
    original model's log-probabilities, one tensor per batch), running from layer `start` on its
    cached input. Never negative, and zero only for the original predictions: unlike a difference
    of perplexities, a small effect cannot come out with the wrong sign."""
    total, count = 0.0, 0
    for (chunk, logits), target in zip(_logits_from_layer(model, layout, start, ids, batch_size, inputs, device),
                                       reference, strict=True):
        log_probs = F.log_softmax(logits.float(), dim=-1)
        total += float(F.kl_div(log_probs, target.to(device, torch.float32), reduction="sum", log_target=True))
        count += chunk.numel()
        del logits, log_probs
    return total / count


class _Candidate(nn.Module):
    """A projection's dense weight during one measurement; the original module is put back after."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


@contextlib.contextmanager
def replaced(layer: nn.Module, layout: AttentionLayout, proj: str, weight: torch.Tensor) -> Iterator[None]:
    """`layer` with projection `proj` computing `x @ weight` (`(in, out)` layout) instead; the rows
    of a fused Q/K/V module outside `proj` stay the original ones."""
    name = layout.projections[proj]
    module = get_module(layer, name)
    dense = weight.T.to(module.weight.device, torch.float32)
    if proj != "o" and name == layout.fused_qkv:
        start, stop = layout.qkv_rows[proj]
        dense = torch.cat([module.weight[:start].float(), dense, module.weight[stop:].float()])
    set_module(layer, name, _Candidate(dense, module.bias))
    try:
        yield
    finally:
        set_module(layer, name, module)


def truncations(method: Method, proj: str, w: torch.Tensor, scale: torch.Tensor, ratios: tuple[float, ...]
                ) -> Iterator[tuple[float, torch.Tensor]]:
    """`(ratio, A B)` for each ratio: `proj`'s ASVD factors at the rank the method gives a budget of
    `int(ratio m n)` values, as stored (`method.storage_dtype`). One SVD serves every rank:
    `scaled_svd` at rank `r` is the first `r` columns of its full-rank result."""
    rows, cols = w.shape
    a, b = scaled_svd(w, scale, min(rows, cols))
    for ratio in ratios:
        rank = dataclasses.replace(method, layer_budget={proj: int(ratio * rows * cols)}).rank(proj, rows, cols)
        stored_a, stored_b = a[:, :rank].to(method.storage_dtype), b[:rank].to(method.storage_dtype)
        yield ratio, stored_a.to(WORK_DTYPE) @ stored_b.to(WORK_DTYPE)


def sensitivities(method: Method, model: nn.Module, layout: AttentionLayout, calib: torch.Tensor, *,
                  batch_size: int, progress: bool = True, ratios: tuple[float, ...] = ASVD_RATIO_CANDIDATES
                  ) -> list[Sensitivity]:
    """ASVD's sensitivity list (§11): the calibration perplexity with each projection alone truncated
    at each ratio, measured on the first `ASVD_SENSITIVITY_SEQUENCES` calibration sequences, on the
    device the model sits on."""
    device = model.get_input_embeddings().weight.device
    scales = activation_scales(model, layout, calib, batch_size, device)
    ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
    inputs = cached_layer_inputs(model, layout, ids, batch_size, device)
    layers = decoder_layers(model, layout)
    entries = []
    with tqdm(total=len(layers) * len(PARTS) * len(ratios), desc="asvd sensitivity", unit="candidate",
              disable=not progress) as bar:
        for index, layer in enumerate(layers):
            weights, _ = projection_weights(layer, layout)
            for proj in PARTS:
                scale = scales[index]["o" if proj == "o" else "qkv"]
                for ratio, truncated in truncations(method, proj, weights[proj].detach().T, scale, ratios):
                    with replaced(layer, layout, proj, truncated):
                        loss = loss_from_layer(model, layout, index, ids, batch_size, inputs[index], device)
                    entries.append(Sensitivity(index, proj, ratio, math.exp(loss)))
                    bar.update()
    return entries


def layer_sensitivities(method: Method, model: nn.Module, layout: AttentionLayout, calib: torch.Tensor, *,
                        batch_size: int, progress: bool = True,
                        ratios: tuple[float, ...] = LAYER_RATIO_CANDIDATES) -> list[Sensitivity]:
    """The layer list of `--allocation sensitivity` (§15): for every ratio and every decoder layer,
    that layer's attention alone compressed by `method` itself at that keep ratio, and the KL
    divergence of the model's predictions from the original ones on the first
    `ASVD_SENSITIVITY_SEQUENCES` calibration sequences.

    Each ratio is one pass of the method over the original model's stream (`no_sequential`: the
    layers before are original when the layer is measured); each compressed layer is measured and
    its original projections put back before the next one is compressed, so the model is unchanged
    afterwards.
    """
    device = model.get_input_embeddings().weight.device
    ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
    inputs = cached_layer_inputs(model, layout, ids, batch_size, device)
    # the original predictions, through the same partial-forward path as every candidate (from layer 0), in
    # float32 on the host (4 x 512 tokens of a 49k vocabulary: 400 MB; float16 would move a layer's divergence
    # by about 1e-5, a few tenths of a percent of the smallest ones measured on SmolLM2)
    with torch.no_grad():
        reference = [F.log_softmax(logits.float(), dim=-1).to("cpu")
                     for _, logits in _logits_from_layer(model, layout, 0, ids, batch_size, inputs[0], device)]
    layers = decoder_layers(model, layout)
    names = sorted(set(layout.projections.values()))
    entries = []
    with tqdm(total=len(layers) * len(ratios), desc="layer sensitivity", unit="candidate",
              disable=not progress) as bar:
        for ratio in ratios:
            probe = dataclasses.replace(method, keep_ratio=ratio, allocation="uniform", budgets=None,
                                        ablations=method.ablations | {"no_sequential"})
            stream = layer_inputs(model, layout, calib, batch_size, device)
            for index, layer in enumerate(layers):
                originals = {name: get_module(layer, name) for name in names}
                try:
                    compress_layer(layer, layout, probe, stream.at(index), torch.float32)
                    loss = divergence_from_layer(model, layout, index, ids, batch_size, inputs[index], reference,
                                                 device)
                finally:
                    for name, module in originals.items():
                        set_module(layer, name, module)
                entries.append(Sensitivity(index, "attention", ratio, loss))
                bar.update()
    return entries


def layer_plan(entries: list[Sensitivity], layout: AttentionLayout, layers: int, rho: float) -> list[dict]:
    """Per-layer `{"qkv", "o"}` budgets from the layer list (§15): one candidate ratio per layer,
    least total divergence within `rho` times the attention of the whole model
    (`ftc.allocation.choose`; divergences of separate layers are added, as for small effects they
    do). A layer's ratio applies to its Q/K/V tensor and its `W_O` alike, the split `uniform` makes."""
    loss = {(e.layer, e.ratio): e.loss for e in entries}
    ratios = sorted({e.ratio for e in entries})
    qkv, o = layout.qkv_params, layout.o_params
    curves = [Curve(f"{i}", tuple(int(r * qkv) + int(r * o) for r in ratios), tuple(loss[i, r] for r in ratios))
              for i in range(layers)]
    try:
        chosen = choose(curves, int(rho * layers * (qkv + o)))
    except ValueError as error:
        raise InputError(f"{error}; raise --ratio to at least {ratios[0]}") from None
    return [{"qkv": int(ratios[i] * qkv), "o": int(ratios[i] * o)} for i in chosen]


def cache_folder() -> Path | None:
    """Where measured sensitivity lists are kept between runs: `$FTC_CACHE_DIR` when set (set and
    empty: nowhere, every run measures), else `$XDG_CACHE_HOME/ftc`, else `~/.cache/ftc`."""
    if (value := os.environ.get(CACHE_ENV)) is not None:
        return Path(value).expanduser() if value else None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftc"


def sensitivity_file(folder: Path, method: Method, model: nn.Module, calib: torch.Tensor) -> Path:
    """The file in `folder` of the sensitivity list of this model, calibration and method, named by a
    digest of all the list depends on but rho: every weight and the configuration of the model, the
    calibration ids, and the method with its fixed choices. Content, not provenance: a model in memory, a
    checkpoint rewritten in place with one of the same size and a new hub revision are told apart by
    what they hold. Hashing reads the model once, seconds against the search's hours."""
    digest = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())
    digest.update(ids_sha256(calib).encode())
    digest.update(json.dumps([method.name, method.choices(), str(method.storage_dtype)], sort_keys=True,
                             default=str).encode())
    kind = "layer-sensitivity" if method.layer_sensitivity else "asvd-sensitivity"
    return folder / kind / f"{digest.hexdigest()}.json"


def cached_sensitivities(path: Path | None, measure: Callable[[], list[Sensitivity]]) -> list[Sensitivity]:
    """The list stored at `path` when one is there and readable, else `measure()`, then stored there
    (written whole or not at all). An unreadable file is measured again and replaced, never trusted
    in part; a cache that cannot be written costs the next run a search, not this one its result."""
    if path is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return [Sensitivity(**entry) for entry in json.loads(path.read_text())["entries"]]
    entries = measure()
    if path is not None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, json.dumps({"entries": [dataclasses.asdict(e) for e in entries]}).encode())
    return entries


def search_budgets(method: Method, model: nn.Module, layout: AttentionLayout, calib: torch.Tensor, *,
                   batch_size: int, progress: bool = True, cache: Path | None = None) -> Method:
    """`method` with budgets from a measured sensitivity list: `asvd`'s per projection from ASVD's
    rank search (§11), `--allocation sensitivity`'s per layer from the method's own layer list
    (`layer_sensitivities`, `layer_plan`, §15).

    The budget is `rho` times the attention parameters of the whole model, the accounting of
    every model-wide plan (§13). Deterministic for the same model and calibration, so a resumed
    run plans the same budgets. Neither list depends on rho: `cache` is the folder it is kept in
    (`cached_sensitivities`), None for none, so a second ratio plans without measuring again.
    """
    if problem := method_ratio_problem(method.name, method.keep_ratio, method.allocation):
        raise InputError(problem)
    layers = len(decoder_layers(model, layout))
    path = None if cache is None else sensitivity_file(cache, method, model, calib)
    if method.layer_sensitivity:
        entries = cached_sensitivities(path, lambda: layer_sensitivities(method, model, layout, calib,
                                                                         batch_size=batch_size, progress=progress))
        return dataclasses.replace(method, budgets=tuple(layer_plan(entries, layout, layers, method.keep_ratio)))
    heads = {"q": layout.heads, "k": layout.kv_heads, "v": layout.kv_heads, "o": layout.heads}
    sizes = {(i, p): layout.hidden * layout.head_dim * heads[p] for i in range(layers) for p in PARTS}
    entries = cached_sensitivities(path, lambda: sensitivities(method, model, layout, calib,
                                                                batch_size=batch_size, progress=progress))
    total = int(method.keep_ratio * layers * (layout.qkv_params + layout.o_params))
    ratios = threshold_ratios(entries, sizes, total)
    return dataclasses.replace(method, budgets=tuple({p: int(ratios[i, p] * sizes[i, p]) for p in PARTS}
                                                     for i in range(layers)))

"""Budgets from measured sensitivity: ASVD's rank search and the layer list of `--allocation sensitivity`.

ASVD's sensitivity-based truncation-rank search (ftc-method.md §11 `asvd`; Yuan et al. 2023,
STRS): for every attention projection and every candidate parameter ratio `p`, the projection
alone is replaced by its ASVD truncation at rank `floor(p m n / (m + n))` and the model's
perplexity on a few calibration sequences is measured; a perplexity threshold is then searched so
that every matrix takes the smallest `p` whose perplexity stays under it, within the model-wide
budget.

The layer list of `--allocation sensitivity` (§15), streamed (`layer_gains`): each layer compressed
once by the planning method (FTC or CP) at a reference ratio, each unit's predicted error curve from
that compression's statistics, scaled by the one KL divergence measured with the unit alone
compressed; one ratio per unit is then chosen for the least summed divergence within the budget. One
layer is resident at a time. `layer_sensitivities` is the earlier design it replaced (every unit at
every candidate ratio, the whole model resident), kept for `benchmarks/plans.py`'s comparison.

ASVD's search needs the loss of the whole model per candidate, so it holds the whole model in
memory, as published. It is cheap where it can be: each decoder layer's input on the
sensitivity sequences is computed once, and a candidate in layer `l` runs only layers `l..L-1`,
the final norm and the head (the model's own forward, with the layers before `l` handing on the
cached hidden state).

Either list depends on the model, the calibration and the method's fixed choices, not on
rho, so it is kept on disk (`cache_folder`) and a second ratio, a resumed run or a sweep over rho
reuses it: the search is paid once per model and calibration, not once per ratio. ASVD's search
also keeps its list so far there (`<name>.partial.json`), so one cut short resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ftc.evaluation.data import ids_sha256
from ftc.models.arch import AttentionLayout, decoder_layers, get_module, projection_weights, set_module
from ftc.models.weights import WeightSource, materialize, release, skeleton, times_weight
from ftc.numerics.allocation import Curve, choose
from ftc.numerics.lowrank import scaled_svd
from ftc.numerics.metric import WORK_DTYPE
from ftc.options import (
    ASVD_RATIO_CANDIDATES,
    ASVD_SENSITIVITY_SEQUENCES,
    ASVD_UNLISTED_RATIO,
    LAYER_RATIO_CANDIDATES,
    PLAN_REFERENCE_RATIO,
    PLAN_WHOLE_UNITS,
    SCOPES,
    InputError,
    method_ratio_problem,
)
from ftc.runtime.artifact import atomic_write_bytes
from ftc.runtime.hf.modeling_ftc import trim_heap

from .pipeline import compress_layer, layer_inputs

if TYPE_CHECKING:
    from .methods import Method

CACHE_ENV = "FTC_CACHE_DIR"
PLAN_LOGIT_POSITIONS = 128
"""Positions whose logits the layer list holds at once (`_head_blocks`): 25 MB of a 49k vocabulary in
float32, against 100 MB for a whole sequence of 512."""
PLAN_REFERENCE_TOP = 64
"""Tokens per position whose logits the layer list's reference keeps (`_Reference`): the linear term
of each divergence is taken from their rounded logits, so their rounding cancels as in a sum over the
vocabulary. Token ids are kept as float32, exact up to 2^24."""
PLAN_PROBE_BATCH = 1
"""Sequences the layer list runs through a decoder layer at once (`_through`, the probe's
propagation): one, as `_head_blocks` reads them. The whole probe (4 x 512 tokens) at once held its
MLP activations, three `tokens x intermediate` float32 buffers (350 MB on a 7B shape), and set the
list's peak when it streamed the later layers in (benchmarks/results/memory.md)."""
SCALE_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "mlp", "up": "mlp", "down": "down"}
"""The input statistic each projection is scaled by in ASVD: its own input's."""


def searched(layout: AttentionLayout, scope: str) -> tuple[str, ...]:
    """The projections ASVD's search measures: the attention's, and with scope `model` the MLP's."""
    return tuple(layout.scoped(scope))


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
    """Per layer, the mean |x| of the Q/K/V input (`"qkv"`), of the `W_O` input (`"o"`), of the MLP
    input (`"mlp"`) and of the `W_down` input (`"down"`) on the original model: the statistic `asvd`
    scales by, on the same calibration batch as its compression."""
    sums: list[dict[str, tuple]] = []
    handles = []
    names = {"qkv": layout.q, "o": layout.o, "mlp": layout.all_projections[layout.mlp_in[0]], "down": layout.down}
    for layer in decoder_layers(model, layout):
        sums.append({})
        for part, name in names.items():

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


def logits_from_layer(model: nn.Module, layout: AttentionLayout, start: int, ids: torch.Tensor, batch_size: int,
                      inputs: list[torch.Tensor], device: torch.device, positions: torch.Tensor | None = None
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`(ids, logits)` per batch of `ids`, with layers `0..start-1` replaced by the cached input of
    layer `start` (`inputs`, one per batch): only the rest of the model runs. `positions` limits
    the logits to those positions (transformers' `logits_to_keep`: the head reads only their
    hidden states, after the final norm of the whole sequence)."""
    layers = decoder_layers(model, layout)
    keep = {} if positions is None else {"logits_to_keep": positions.to(device)}
    for batch, hidden in zip(range(0, ids.shape[0], batch_size), inputs, strict=True):
        chunk = ids[batch : batch + batch_size].to(device)
        h = hidden.to(device)
        for layer in layers[:start]:
            layer.forward = lambda *args, h=h, **kwargs: h
        try:
            logits = model(input_ids=chunk, use_cache=False, **keep).logits
        finally:
            for layer in layers[:start]:
                del layer.forward
        yield chunk, logits


@torch.no_grad()
def loss_from_layer(model: nn.Module, layout: AttentionLayout, start: int, ids: torch.Tensor, batch_size: int,
                    inputs: list[torch.Tensor], device: torch.device) -> float:
    """Mean next-token cross-entropy of the model on `ids`, running from layer `start` on its cached
    input (`logits_from_layer`). The head reads only the positions that predict a token: the last
    position's logits are never used, and a slice of the full logits would be copied whole before
    the loss (a second 2 GB on Gemma's 262k vocabulary, a second a candidate on two threads)."""
    total, count = 0.0, 0
    positions = torch.arange(ids.shape[1] - 1)
    for chunk, logits in logits_from_layer(model, layout, start, ids, batch_size, inputs, device, positions):
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum"))
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
    for (chunk, logits), target in zip(logits_from_layer(model, layout, start, ids, batch_size, inputs, device),
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
    of a fused Q/K/V (gate/up) module outside `proj` stay the original ones."""
    name = layout.all_projections[proj]
    module = get_module(layer, name)
    dense = weight.T.to(module.weight.device, torch.float32)
    rows = {layout.fused_qkv: layout.qkv_rows, layout.fused_gate_up: layout.gate_up_rows}.get(name, {})
    if proj in rows:
        start, stop = rows[proj]
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
                  batch_size: int, progress: bool = True, ratios: tuple[float, ...] = ASVD_RATIO_CANDIDATES,
                  done: Iterable[Sensitivity] = (), checkpoint: Callable[[list[Sensitivity]], None] | None = None
                  ) -> list[Sensitivity]:
    """ASVD's sensitivity list (§11): the calibration perplexity with each projection alone truncated
    at each ratio, measured on the first `ASVD_SENSITIVITY_SEQUENCES` calibration sequences, on the
    device the model sits on.

    The whole-model list of Gemma-3-270M is 1134 candidates of about ten seconds each on two CPU
    cores, hours a job can lose to a restart: `checkpoint` is handed the list so far after each
    projection's candidates, and a projection whose every ratio is in `done` (what a checkpoint kept
    before the run was cut short) is taken from there, not measured again. Each candidate is measured
    on the original model alone, so the resumed list is the one an uninterrupted search gives."""
    device = model.get_input_embeddings().weight.device
    projections = searched(layout, method.scope)
    layers = decoder_layers(model, layout)
    kept = {(e.layer, e.proj, e.ratio): e for e in done}
    reused = {(i, p) for i in range(len(layers)) for p in projections if all((i, p, r) in kept for r in ratios)}
    if len(reused) < len(layers) * len(projections):
        scales = activation_scales(model, layout, calib, batch_size, device)
        ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
        inputs = cached_layer_inputs(model, layout, ids, batch_size, device)
    entries: list[Sensitivity] = []
    with tqdm(total=len(layers) * len(projections) * len(ratios), initial=len(reused) * len(ratios),
              desc="asvd sensitivity", unit="candidate", disable=not progress) as bar:
        for index, layer in enumerate(layers):
            weights, _ = projection_weights(layer, layout, layout.scoped(method.scope))
            for proj in projections:
                if (index, proj) in reused:
                    entries.extend(kept[index, proj, r] for r in ratios)
                    continue
                scale = scales[index][SCALE_OF[proj]]
                for ratio, truncated in truncations(method, proj, weights[proj].detach().T, scale, ratios):
                    with replaced(layer, layout, proj, truncated):
                        loss = loss_from_layer(model, layout, index, ids, batch_size, inputs[index], device)
                    entries.append(Sensitivity(index, proj, ratio, math.exp(loss)))
                    bar.update()
                if checkpoint is not None:
                    checkpoint(entries)
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
                     for _, logits in logits_from_layer(model, layout, 0, ids, batch_size, inputs[0], device)]
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
    (`ftc.numerics.allocation.choose`; divergences of separate layers are added, as for small effects they
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
    description = [method.name, method.choices(), str(method.storage_dtype)]
    if method.scope != "attention":  # the projections measured; kept out for attention, so earlier lists still apply
        description.append(method.scope)
    digest.update(json.dumps(description, sort_keys=True, default=str).encode())
    kind = "layer-sensitivity" if method.layer_sensitivity else "asvd-sensitivity"
    return folder / kind / f"{digest.hexdigest()}.json"


def cached_sensitivities(path: Path | None, measure: Callable[[], list], kind: type = Sensitivity) -> list:
    """The list stored at `path` when one is there and readable, else `measure()`, then stored there
    (written whole or not at all). An unreadable file is measured again and replaced, never trusted
    in part; a cache that cannot be written costs the next run a search, not this one its result.
    `kind` is the dataclass of the entries (`Sensitivity`, `UnitCurve`)."""
    if path is not None and (entries := read_entries(path, kind)) is not None:
        return entries
    entries = measure()
    if path is not None:
        write_entries(path, entries)
    return entries


def read_entries(path: Path, kind: type = Sensitivity) -> list | None:
    """The entries of a list file (`cached_sensitivities`, or a search's partial list), None when it
    is missing or unreadable: a damaged file is never trusted in part."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return [kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()})
                for entry in json.loads(path.read_text())["entries"]]
    return None


def write_entries(path: Path, entries: list) -> None:
    """`entries` written to `path` whole or not at all; a folder that cannot be written is no error
    (the list is a cache: losing it costs a later run a search, not this one its result)."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps({"entries": [dataclasses.asdict(e) for e in entries]}).encode())


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
    projections = searched(layout, method.scope)
    sizes = {(i, p): projection_size(layout, p) for i in range(layers) for p in projections}
    partial = None if path is None else path.with_suffix(".partial.json")  # a search cut short resumes from it

    def measure() -> list[Sensitivity]:
        done = [] if cache is None or partial is None else [
            *(read_entries(partial) or ()), *wider_entries(cache, method, model, layout, calib)]
        return sensitivities(method, model, layout, calib, batch_size=batch_size, progress=progress, done=done,
                             checkpoint=None if partial is None else lambda entries: write_entries(partial, entries))

    entries = cached_sensitivities(path, measure)
    if partial is not None:
        with contextlib.suppress(OSError):  # a folder that cannot be written is no error (`write_entries`)
            partial.unlink(missing_ok=True)
    total = int(method.keep_ratio * layers * sum(layout.part_params(method.scope).values()))
    ratios = threshold_ratios(entries, sizes, total)
    return dataclasses.replace(method, budgets=tuple({p: int(ratios[i, p] * sizes[i, p]) for p in projections}
                                                     for i in range(layers)))


def wider_entries(cache: Path, method: Method, model: nn.Module, layout: AttentionLayout, calib: torch.Tensor
                  ) -> list[Sensitivity]:
    """The candidates a kept list of a wider scope already holds (whole or partial): the whole-model
    list measures every attention candidate the attention list needs. Each candidate is measured on
    the original model alone, whatever else the search covers, so a list is the same read from
    there as measured again; on Gemma-3-270M that is the attention search's hour."""
    ours = set(searched(layout, method.scope))
    entries: list[Sensitivity] = []
    for scope in SCOPES:
        if scope != method.scope and ours < set(searched(layout, scope)):
            path = sensitivity_file(cache, dataclasses.replace(method, scope=scope), model, calib)
            for found in (path, path.with_suffix(".partial.json")):
                entries.extend(e for e in read_entries(found) or () if e.proj in ours)
    return entries


def projection_size(layout: AttentionLayout, proj: str) -> int:
    """Parameters of one projection of a decoder layer."""
    heads = {"q": layout.heads, "k": layout.kv_heads, "v": layout.kv_heads, "o": layout.heads}
    if proj in heads:
        return layout.hidden * layout.head_dim * heads[proj]
    return layout.hidden * layout.intermediate


# ---------------------------------------------------------------------------------------------
# the streamed layer plan (§15): predicted error curves, scaled by one measured divergence per unit

@dataclass(frozen=True)
class UnitCurve:
    """One unit of a decoder layer (its attention, or its MLP): the predicted relative error of its
    parts at each candidate keep ratio, and the divergence measured with it alone compressed at
    `PLAN_REFERENCE_RATIO`. Its predicted divergence at ratio `r` is `gain * error(r)`."""

    layer: int
    unit: str
    ratios: tuple[float, ...]
    errors: tuple[float, ...]
    divergence: float
    reference_error: float

    @property
    def gain(self) -> float:
        return self.divergence / max(self.reference_error, 1e-30)

    def predicted(self) -> tuple[float, ...]:
        return tuple(self.gain * e for e in self.errors)


UNITS = {"attention": ("qkv", "o"), "mlp": ("gateup", "down")}
"""The units a layer is planned in and the budgeted parts each holds (`ftc.models.arch` `part_params`)."""


class _Surveying:
    """Wraps the planning method at the reference ratio: each part's statistics, as the pipeline
    hands them over, also give that part's predicted error curve over `ratios` (the allocator's
    prediction for a tensor, §6; the tail of the whitened spectrum for a matrix, §8), measured
    before the method takes the Grams over. Everything else is the method's own."""

    def __init__(self, method: Method, ratios: tuple[float, ...]) -> None:
        self.method, self.ratios = method, ratios
        self.curves: dict[str, list[float]] = {}

    def __getattr__(self, name: str):
        return getattr(self.method, name)

    def at_layer(self, index: int):
        self.curves = {}
        return self

    def _tensor_curve(self, tensor: torch.Tensor, gram: torch.Tensor, size: int, weights) -> list[float]:
        from ftc.numerics.allocation import tucker_curve
        from ftc.numerics.metric import Whitening

        return tucker_curve(tensor, Whitening.from_gram(gram), [int(r * size) for r in self.ratios],
                            weights=weights, dense_core=self.method.dense_core)

    def _matrix_curve(self, w: torch.Tensor, gram: torch.Tensor) -> list[float]:
        from ftc.numerics.metric import Whitening

        # the whitening is a temporary: its factor is freed before the SVD runs
        spectrum = torch.linalg.svdvals(Whitening.from_gram(gram).apply_by_columns(w)).pow(2)
        rows, cols = w.shape
        tail = (spectrum.sum() - torch.cumsum(spectrum, 0)) / spectrum.sum().clamp_min(1e-300)
        ranks = [max(1, int(r * rows * cols) // (rows + cols)) for r in self.ratios]
        return [float(tail[min(rank, len(tail)) - 1]) for rank in ranks]

    def qkv(self, weights, x, layout):
        tensor, repeat = self.method.qkv_tensor(weights, layout)
        self.curves["qkv"] = self._tensor_curve(tensor, x.gram, layout.qkv_params,
                                                self.method.slice_weights(layout, repeat))
        del tensor  # the method builds its own
        return self.method.qkv(weights, x, layout)

    def o(self, w_o, ctx, layout):
        self.curves["o"] = self._matrix_curve(w_o, ctx.teacher.gram)
        return self.method.o(w_o, ctx, layout)

    def mlp_in(self, weights, x, layout):
        tensor = torch.stack([weights[p] for p in layout.mlp_in])
        self.curves["gateup"] = self._tensor_curve(tensor, x.gram, layout.mlp_in_params, None)
        del tensor
        return self.method.mlp_in(weights, x, layout)

    def mlp_out(self, w_down, ctx, layout):
        self.curves["down"] = self._matrix_curve(w_down, ctx.teacher.gram)
        return self.method.mlp_out(w_down, ctx, layout)


@torch.no_grad()
def _through(model: nn.Module, layout: AttentionLayout, weights: WeightSource, probe, hidden: list[torch.Tensor],
             start: int, device: torch.device, compute_dtype: torch.dtype, resident: bool = True,
             stop: int | None = None) -> list[torch.Tensor]:
    """`hidden` (the probe's input of layer `start`, one tensor per batch) through layers `start..stop-1`
    (to the last one by default): layer `start` as it is now when `resident`, every other one
    materialised from `weights` for the moment it runs."""
    layers = decoder_layers(model, layout)
    hidden = list(hidden)
    for index in range(start, len(layers) if stop is None else stop):
        name = f"{layout.layers_path}.{index}"
        streamed = index != start or not resident
        if streamed:
            materialize(model, name, weights, device, compute_dtype)
        for b, (_, kw) in enumerate(probe.at(index).batches()):
            out = layers[index](hidden[b].to(device), **kw)
            hidden[b] = out[0] if isinstance(out, tuple) else out
        if streamed:
            release(model, name)
    return hidden


def _head_blocks(model: nn.Module, layout: AttentionLayout, ids: torch.Tensor, final: list[torch.Tensor],
                 device: torch.device) -> Iterator[tuple[torch.Tensor | None, torch.Tensor]]:
    """`(head input, logits)` from the last layer's output, through the model's own final norm and
    head (and any logit soft-capping), one sequence and `PLAN_LOGIT_POSITIONS` positions at a time: a
    whole sequence's logits of a 49k vocabulary are 100 MB, and the divergence's temporaries as many
    again each, which set the list's peak on a 7B shape (`benchmarks/results/memory.md`). The same
    values: a position's logits depend on its own hidden state only. The head input (the final norm's
    output at those positions) is None where the logits are not the output of a `nn.Linear` head as
    it is (Gemma 2 soft-caps them): `_Reference` then reads them the long way."""
    head, seen = model.get_output_embeddings(), {}

    def keep(_module, args, out) -> None:
        seen["x"], seen["z"] = args[0], out

    layers, length = len(decoder_layers(model, layout)), ids.shape[1]
    with _hooks([head.register_forward_hook(keep)]):
        for sequence, hidden in zip(ids, (row for batch in final for row in batch), strict=True):  # no joined copy
            for start in range(0, length, PLAN_LOGIT_POSITIONS):
                positions = torch.arange(start, min(start + PLAN_LOGIT_POSITIONS, length))
                for _, logits in logits_from_layer(model, layout, layers, sequence[None], 1, [hidden[None]], device,
                                                   positions):
                    affine = isinstance(head, nn.Linear) and seen.pop("z", None) is logits
                    x = seen.pop("x")
                    yield (x[0] if affine else None), logits[0]


class _Reference:
    """The original model's next-token distributions on the probe, kept as each divergence reads them.

    Where the head is affine (logits `z = W x + b` of the final norm's output `x`), the KL divergence of
    a distribution from the original's is the Bregman divergence of the log-partition function
    `A(x) = logsumexp(W x + b)` between the two head inputs:

        KL(p0 || p) = A(x) - A(x0) - p0 . (z - z0),   p0 . (z - z0) = (x - x0) . W^T p0,

    exactly (`sum p0 log p0 - sum p0 z0 = -A(x0)`). So the reference keeps per position `x0`, `W^T p0`
    and `A(x0)` (in float64), and a divergence needs only its logits' logsumexp: no log-softmax, no
    second exponential over the vocabulary, no vocabulary-wide block read back per position (400 MB of
    log-probabilities for SmolLM2's probe, read once per unit). One refinement keeps it as precise as
    the sum over the vocabulary: the float32 rounding of the logits inside `A` (about their last
    place, 2e-6 at 20, per position) cancels to first order only where the linear term is taken from
    the same rounded logits, so for the `PLAN_REFERENCE_TOP` most likely tokens (nearly all of `p0`'s
    mass) it is, `sum_top p0 (z - z0)` from the logits themselves, and `W^T p0` covers the rest. On
    SmolLM2's list the divergences are those of the sum over the vocabulary to 1e-4 and plan the same
    budgets (docs/results.md). Heads whose logits are post-processed (Gemma 2's soft-capping) keep the
    log-probabilities, spilled, and sum over the vocabulary.
    """

    def __init__(self, blocks: Iterator[tuple[torch.Tensor | None, torch.Tensor]], head: nn.Module) -> None:
        self.partition: list[torch.Tensor] = []  # A(x0) per block, float64 (affine heads)
        self.affine = True
        self.top = min(PLAN_REFERENCE_TOP, head.weight.shape[0])  # tokens kept per position

        def kept() -> Iterator[torch.Tensor]:
            weight = head.weight  # a 16-bit head stays so: `times_weight` converts it a block at a time
            for x, logits in blocks:
                z = logits.float()
                if x is None:
                    self.affine = False
                    yield F.log_softmax(z, dim=-1)
                    continue
                self.partition.append(_log_partition(z))
                p0 = torch.softmax(z, dim=-1)
                top, index = p0.topk(self.top, dim=-1)
                rest = times_weight(p0.scatter_(-1, index, 0.0), weight)  # W^T p0 outside the top
                yield torch.cat([x.float(), rest, z.gather(-1, index), top, index.float()], dim=-1)

        self.blocks = SpilledTensors(kept())

    def divergence(self, blocks: Iterator[tuple[torch.Tensor | None, torch.Tensor]]) -> float:
        """Mean KL divergence per token of the distributions of `blocks` (`_head_blocks` of the model
        as it is now) from the reference's."""
        total, count = 0.0, 0
        partitions = iter(self.partition)
        for (x, logits), kept in zip(blocks, self.blocks, strict=True):
            z = logits.float()
            kept = kept.to(z.device)
            if self.affine:
                width = x.shape[-1]
                x0, rest, z0, top, index = kept.split([width, width, self.top, self.top, self.top], dim=-1)
                linear = (((x.double() - x0.double()) * rest.double()).sum(-1)
                          + (top.double() * (z.gather(-1, index.long()) - z0).double()).sum(-1))
                total += float((_log_partition(z) - next(partitions).to(z.device) - linear).sum())
            else:
                total += float(F.kl_div(F.log_softmax(z, dim=-1), kept, reduction="sum", log_target=True))
            count += z.shape[0]
        return max(0.0, total / count)  # a KL divergence is never negative; rounding may take a near-zero one below


def _log_partition(z: torch.Tensor) -> torch.Tensor:
    """`logsumexp` of each row of `z` in float64, from float32 exponentials: the maximum is added in
    float64, so the difference of two of them (`_Reference`: values near 20 whose difference is part
    of a divergence of 1e-3) keeps the precision of the sum of exponentials, not the float32 rounding
    of a value near 20."""
    top = z.max(dim=-1, keepdim=True).values
    return top[..., 0].double() + (z - top).exp_().sum(-1).double().log()


class SpilledTensors:
    """Float32 tensors kept in a temporary file rather than in memory, read back in order one at a time:
    the layer list's reference one block of positions at a time (`_Reference`: float16 would err by
    1e-5 per token, the size of the smallest divergences; 69 MB in all on a 7B shape, kept out of the
    list's peak), and the loss metric's layer inputs (`ftc.compression.gradients`).

    Each block is read straight into one buffer reused for every block and every reading (the list
    reads the file once per unit): a fresh array per block cost a second copy and its page faults,
    14% of the list's time when the reference was its log-probabilities. A yielded tensor is valid
    until the next one is read."""

    def __init__(self, sequences: Iterator[torch.Tensor]) -> None:
        import tempfile

        self.file = tempfile.TemporaryFile()
        self.shapes: list[tuple[int, ...]] = []
        self._buffer: torch.Tensor | None = None
        for sequence in sequences:
            array = sequence.detach().to("cpu", torch.float32).contiguous().numpy()
            self.file.write(array.tobytes())
            self.shapes.append(array.shape)

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.file.seek(0)
        for shape in self.shapes:
            if self._buffer is None or tuple(self._buffer.shape) != shape:
                self._buffer = None  # freed before its successor exists
                self._buffer = torch.empty(shape, dtype=torch.float32)
            view = memoryview(self._buffer.numpy()).cast("B")
            if self.file.readinto(view) != view.nbytes:
                raise OSError(f"the spilled tensors in {self.file.name} were cut short")
            yield self._buffer


def layer_gains(method: Method, weights: WeightSource, layout: AttentionLayout, calib: torch.Tensor, *,
                device: torch.device, batch_size: int, progress: bool = True,
                ratios: tuple[float, ...] = LAYER_RATIO_CANDIDATES,
                compute_dtype: torch.dtype = torch.float32) -> list[UnitCurve]:
    """The layer list of `--allocation sensitivity` (§15), streamed: one decoder layer resident at a
    time, as the compression itself. A layer's MLP is loaded once its attention's math is done; each
    unit's output of the layer is computed while the layer is resident, and the layer is released
    before the later layers stream in for the divergences; the output head is resident only while
    they are read. On a 7B shape, a second layer or the head beside the layer being compressed would
    each add 0.4 GB to the peak (`benchmarks/memory.py`).

    One pass over the original model's stream. Layer by layer, the planning method compresses the
    layer at `PLAN_REFERENCE_RATIO` (`no_sequential`), which gives every part's predicted error
    curve over `ratios` from the statistics it gathers (`_Surveying`); each unit (the attention, and
    with scope `model` the MLP) is then measured alone: the KL divergence of the model's predictions
    on the first `ASVD_SENSITIVITY_SEQUENCES` calibration sequences from the original's, with only that
    unit compressed, the later layers streamed in for the measurement. The layer is then restored
    and the streams move on through the original layer.
    """
    from ftc.models.weights import materialize_embedding_rows

    from .pipeline import after_attention, compress_layer, map_large_allocations, propagate

    bounded = not weights.resident  # streamed from disk: keep host memory low, as `compress_layers` does
    if bounded:
        map_large_allocations()
    model = skeleton(weights.config)
    ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
    materialize_embedding_rows(model, weights, calib, device)
    head = head_modules(model, layout)
    stream = layer_inputs(model, layout, calib, batch_size, device)
    probe = layer_inputs(model, layout, ids, PLAN_PROBE_BATCH, device)
    original = _through(model, layout, weights, probe, probe.hidden, 0, device, compute_dtype, resident=False)
    with materialized(model, head, weights, device, compute_dtype):
        reference = _Reference(_head_blocks(model, layout, ids, original, device), model.get_output_embeddings())
    del original
    planner = _Surveying(dataclasses.replace(method, keep_ratio=PLAN_REFERENCE_RATIO, allocation="uniform",
                                             budgets=None, ablations=method.ablations | {"no_sequential"}), ratios)
    layers = decoder_layers(model, layout)
    units = {unit: parts for unit, parts in UNITS.items() if unit == "attention" or method.scope == "model"}
    names = {"attention": set(layout.projections.values()), "mlp": set(layout.mlp_projections.values())}
    curves = []
    at = ratios.index(PLAN_REFERENCE_RATIO)
    for index in tqdm(range(len(layers)), desc="layer plan", unit="layer", disable=not progress):
        name, layer = f"{layout.layers_path}.{index}", layers[index]
        later = after_attention(layer, layout)  # the MLP, loaded once the attention's math is done
        materialize(model, name, weights, device, compute_dtype, include=lambda p, later=later: not later(p))
        originals = {n: get_module(layer, n) for unit in units for n in names[unit]}
        inputs = [h.clone() for h in probe.hidden]
        compress_layer(layer, layout, planner.at_layer(index), stream.at(index), compute_dtype, trim=bounded,
                       load_rest=lambda name=name, later=later: materialize(model, name, weights, device,
                                                                           compute_dtype, include=later))
        compressed = {n: get_module(layer, n) for n in originals}
        outputs = {}
        try:
            for unit in units:
                for n in originals:  # this unit alone compressed
                    set_module(layer, n, compressed[n] if n in names[unit] else originals[n])
                outputs[unit] = _through(model, layout, weights, probe, inputs, index, device, compute_dtype,
                                         stop=index + 1)
        finally:
            for n, module in originals.items():
                set_module(layer, n, module)
        propagate(layer, probe.at(index))
        del compressed, originals, layer, inputs
        release(model, name)  # before the later layers stream in: one layer resident at a time
        finals = {unit: _through(model, layout, weights, probe, outputs.pop(unit), index + 1, device, compute_dtype,
                                 resident=False) for unit in units}
        with materialized(model, head, weights, device, compute_dtype):  # the head: only while it is read
            for unit, parts in units.items():
                divergence = reference.divergence(_head_blocks(model, layout, ids, finals.pop(unit), device))
                errors = tuple(sum(planner.curves[p][i] for p in parts) for i in range(len(ratios)))
                curves.append(UnitCurve(index, unit, tuple(ratios), errors, divergence, errors[at]))
        if bounded:
            trim_heap()
    return curves


@contextlib.contextmanager
def materialized(model: nn.Module, names: list[str], weights: WeightSource, device: torch.device,
                 compute_dtype: torch.dtype) -> Iterator[None]:
    """The modules `names` materialised from `weights` for the block, released after it: the output
    head of a 7B-shaped model is 0.4 GB in float16, as much as a decoder layer, and the list needs it
    only while it reads divergences, not while a layer is compressed."""
    for name in names:
        materialize(model, name, weights, device, compute_dtype)
    try:
        yield
    finally:
        for name in names:
            release(model, name)


def head_modules(model: nn.Module, layout: AttentionLayout) -> list[str]:
    """The modules after the decoder layers: the final norm(s) and the output head."""
    layers_path = layout.layers_path
    owner = layers_path.rpartition(".")[0]
    base = model.get_submodule(owner) if owner else model
    norms = [f"{owner}.{n}" if owner else n for n, m in base.named_children()
             if n != layers_path.rpartition(".")[2] and any(True for _ in m.parameters()) and
             m is not model.get_input_embeddings()]
    head = [n for n, m in model.named_children() if m is model.get_output_embeddings()]
    return norms + head


def gains_plan(curves: list[UnitCurve], layout: AttentionLayout, layers: int, rho: float, scope: str) -> list[dict]:
    """Per-layer budgets by part from the streamed layer list (§15): one candidate ratio per unit,
    the least total predicted divergence within `rho` times the parameters the scope compresses
    (`ftc.numerics.allocation.choose`). A unit's ratio applies to each of its parts, the split `uniform`
    makes. With `PLAN_WHOLE_UNITS` a unit may also stay whole: its parts' full size, no divergence;
    such units are listed under the layer's `"whole"`."""
    params = layout.part_params(scope)
    plan: list[dict] = [{} for _ in range(layers)]
    whole = (1.0,) if PLAN_WHOLE_UNITS else ()
    chosen_curves = [Curve(f"{c.layer}.{c.unit}", tuple(sum(int(r * params[p]) for p in UNITS[c.unit])
                                                         for r in (*c.ratios, *whole)),
                           (*c.predicted(), *(0.0 for _ in whole))) for c in curves]
    try:
        chosen = choose(chosen_curves, int(rho * layers * sum(params.values())))
    except ValueError as error:
        raise InputError(f"{error}; raise --ratio to at least {min(curves[0].ratios)}") from None
    for curve, position in zip(curves, chosen, strict=True):
        ratio = (*curve.ratios, *whole)[position]
        plan[curve.layer].update({p: int(ratio * params[p]) for p in UNITS[curve.unit]})
        if position == len(curve.ratios):
            plan[curve.layer].setdefault("whole", []).append(curve.unit)
    return plan


def weights_digest(weights: WeightSource) -> hashlib._Hash:
    """A digest of a checkpoint's content, read one tensor at a time: its configuration and every
    weight (names, dtypes, shapes, bytes). What the plan depends on, not where the file lies."""
    digest = hashlib.sha256(weights.config.to_json_string(use_diff=False).encode())
    for name in sorted(weights.names()):
        tensor = weights.get(name)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())
        del tensor
    return digest


def plan_key(method: Method, weights: WeightSource, calib: torch.Tensor) -> str:
    """The name a streamed layer list is kept under (locally and in a service's object store): a
    digest of the checkpoint's content, the calibration ids, the method with its fixed choices and
    the scope. It does not depend on rho, so every ratio plans from one list."""
    digest = weights_digest(weights)
    digest.update(ids_sha256(calib).encode())
    digest.update(json.dumps([method.name, method.choices(), str(method.storage_dtype), method.scope],
                             sort_keys=True, default=str).encode())
    return digest.hexdigest()


def streamed_budgets(method: Method, weights: WeightSource, layout: AttentionLayout, calib: torch.Tensor, *,
                     device: torch.device, batch_size: int, progress: bool = True, cache: Path | None = None,
                     store: PlanStore | None = None) -> Method:
    """`method` with the budgets of `--allocation sensitivity` (§15) from its streamed layer list
    (`layer_gains`, `gains_plan`), read from `store` or the `cache` folder when measured before
    (`plan_key`), measured and kept there otherwise."""
    if problem := method_ratio_problem(method.name, method.keep_ratio, method.allocation):
        raise InputError(problem)
    layers = len(decoder_layers(skeleton(weights.config), layout))
    key = plan_key(method, weights, calib) if (cache is not None or store is not None) else None

    def measure() -> list[UnitCurve]:
        return layer_gains(method, weights, layout, calib, device=device, batch_size=batch_size, progress=progress)

    if store is not None and key is not None:
        curves = store.curves(key, measure)
    else:
        path = None if cache is None or key is None else cache / "layer-plan" / f"{key}.json"
        curves = cached_sensitivities(path, measure, UnitCurve)
    return dataclasses.replace(method, budgets=tuple(gains_plan(curves, layout, layers, method.keep_ratio,
                                                                method.scope)))


class PlanStore:
    """Where layer lists are shared beyond one machine's cache folder (a service's object store):
    `curves(key, measure)` returns the list kept under `key`, or measures it, keeps it and returns it.
    An implementation makes two callers that start the same key at once measure it once."""

    def curves(self, key: str, measure: Callable[[], list[UnitCurve]]) -> list[UnitCurve]:
        raise NotImplementedError

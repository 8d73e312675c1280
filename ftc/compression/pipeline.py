"""The sequential layer-by-layer pipeline (ftc-method.md §3, §8): statistics, compress, propagate.

One hidden-state stream of the calibration batch is carried from layer to layer. For FTC it is
the *student* stream (layers before `l` already compressed); the baselines and the
`no_sequential` ablation carry the original model's (*teacher*) stream instead. The pipeline knows
nothing about the method's math: it gathers statistics, hands them to the method, installs the
modules built from the method's stored tensors, and moves the stream on.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ftc.models.arch import AttentionLayout, decoder_layers, get_module, layer_types, projection_weights, set_module
from ftc.models.weights import WeightSource, materialize, release
from ftc.numerics.metric import Moments, accumulate_product, gram_buffer
from ftc.runtime.hf.modeling_ftc import place, trim_heap
from ftc.runtime.stored import build_modules

from .methods import ContextStats, Group, Method


class _Captured(Exception):
    """Raised by a capture hook to stop a forward pass once the wanted input is recorded."""


@dataclass
class LayerResult:
    index: int
    groups: list[Group]
    report: dict
    seconds: float
    total: int
    """Number of decoder layers in the model (for "layer i of L" progress)."""


@dataclass
class Stream:
    """Calibration hidden states at the current depth, one tensor per batch, plus layer kwargs."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]
    device: torch.device
    typed: list[dict[str, dict]] | None = None
    """Per batch, the kwargs of each layer type, where layers of different types get different
    ones (Gemma 2/3: a sliding-window mask and local rotary base vs the global ones); `kwargs` is
    then layer 0's. See `at`."""
    layer_types: tuple[str, ...] = ()

    def at(self, index: int) -> Stream:
        """The stream as decoder layer `index` sees it: its type's kwargs, the same hidden list
        (so `propagate` through the view advances this stream)."""
        if not self.typed:
            return self
        kind = self.layer_types[index]
        return dataclasses.replace(self, kwargs=[kw[kind] for kw in self.typed])

    def batches(self) -> Iterator[tuple[torch.Tensor, dict]]:
        for h, kw in zip(self.hidden, self.kwargs, strict=True):
            yield h.to(self.device, non_blocking=True), kw

    def keep(self, h: torch.Tensor) -> torch.Tensor:
        """Host copy of a batch; page-locked when a GPU will read it back asynchronously."""
        h = h.detach().to("cpu")
        return h.pin_memory() if self.device.type == "cuda" else h


@dataclass
class PipelineResult:
    layers: list[LayerResult] = field(default_factory=list)
    seconds: float = 0.0


def _layer_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def layer_inputs(
    model: nn.Module,
    layout: AttentionLayout,
    input_ids: torch.Tensor,
    batch_size: int,
    device: torch.device,
    store: torch.device | str = "cpu",
) -> Stream:
    """Run the embeddings up to the first decoder layer and keep its inputs and kwargs per batch.

    The kwargs (rotary position embeddings, causal mask...) are whatever the model passes its
    layers, captured rather than rebuilt, so every architecture family works the same way. They
    are captured per layer type (`arch.layer_types`): during the pass every decoder layer's forward
    is a stub that records the kwargs of the first layer of its type and hands its input on
    unchanged, and the pass stops once every type is recorded. One set per type per batch is
    kept, and no decoder layer runs (their weights need not even be resident).
    """
    layers = decoder_layers(model, layout)
    types = layer_types(model.config, len(layers))
    distinct = len(set(types))
    stream = Stream([], [], device, [] if distinct > 1 else None, types if distinct > 1 else ())
    seen: dict[str, dict] = {}

    def stub(index: int) -> Callable:
        def forward(*args, **kw):
            h = args[0] if args else kw.pop("hidden_states")
            if index == 0:
                stream.hidden.append(stream.keep(h))
            seen.setdefault(types[index], {k: v for k, v in kw.items() if k != "hidden_states"})
            if len(seen) == distinct:
                raise _Captured
            return h

        return forward

    for index, layer in enumerate(layers):
        layer.forward = stub(index)
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            seen.clear()
            with contextlib.suppress(_Captured):
                model(input_ids=input_ids[start : start + batch_size].to(device), use_cache=False)
            stream.kwargs.append(seen[types[0]])
            if stream.typed is not None:
                stream.typed.append(dict(seen))
    finally:
        for layer in layers:
            del layer.forward
    return stream


@torch.no_grad()
def capture_input(layer: nn.Module, name: str, h: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The input of submodule `name` when `layer` runs on `h`; the forward stops right there."""
    seen: list[torch.Tensor] = []

    def hook(_module, args):
        seen.append(args[0])
        raise _Captured

    handle = get_module(layer, name).register_forward_pre_hook(hook)
    try:
        with contextlib.suppress(_Captured):
            layer(h, **kwargs)
    finally:
        handle.remove()
    return seen[0]


@contextlib.contextmanager
def swapped(layer: nn.Module, layout: AttentionLayout, modules: dict[str, nn.Module]):
    """Temporarily install `modules` (keyed q/k/v/o/gate/up/down) in `layer`."""
    names = layout.all_projections
    before = {names[p]: get_module(layer, names[p]) for p in modules}
    place(layer, names, modules)
    try:
        yield
    finally:
        for name, m in before.items():
            set_module(layer, name, m)


class _Replay(nn.Module):
    """Stands in for a layer's attention block: `out_proj(A)` for a context `A` already computed.

    The statistics pass has run the attention (softmax included) on these very inputs with these
    very Q/K/V modules and kept its context `A`, the input of the output projection; propagation
    then only needs the output projection, the residual and the MLP. Every supported family's
    attention block returns `(out_proj(A), attention weights)`.
    """

    def __init__(self, out_proj: nn.Module, context: torch.Tensor) -> None:
        super().__init__()
        self.out_proj = out_proj
        self.context = context

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return self.out_proj(self.context), None


REPLAY_TOKENS = 1024
"""Tokens per piece of a batch propagated past a replayed attention: the MLP's activations (three
`tokens x intermediate` float32 buffers, 700 MB for a 4096-token batch at a 7B shape) scale with it."""


def _replayed(layer: nn.Module, layout: AttentionLayout, h: torch.Tensor, context: torch.Tensor,
              device: torch.device, run: Callable[[torch.Tensor], torch.Tensor]
              ) -> Iterator[tuple[slice, torch.Tensor]]:
    """`run(piece)` on pieces of whole sequences of `h` (about `REPLAY_TOKENS` tokens each) with the
    attention block replaced by `_Replay` of `context`: `(rows, result)` per piece."""
    block = layout.o.rpartition(".")[0]
    attention, out_proj = get_module(layer, block), get_module(layer, layout.o)
    rows = max(1, REPLAY_TOKENS // max(1, h[0].numel() // h.shape[-1]))  # sequences per piece
    try:
        for start in range(0, h.shape[0], rows):
            piece = slice(start, start + rows)
            set_module(layer, block, _Replay(out_proj, context[piece].to(device)))
            yield piece, run(h[piece])
    finally:
        set_module(layer, block, attention)


@torch.no_grad()
def propagate(
    layer: nn.Module, stream: Stream, layout: AttentionLayout | None = None, contexts: list | None = None
) -> None:
    """Advance the stream through `layer` in place (per batch, results kept where they were).

    With `contexts` (one attention context per batch, from `context_stats` on the same stream and
    the same Q/K/V), the attention is not recomputed: see `_Replay`. Each context is dropped once used.
    Everything after the attention acts on each token alone, so a replayed batch goes through in
    pieces of whole sequences, about `REPLAY_TOKENS` tokens each.
    """
    for i, (h, kw) in enumerate(stream.batches()):
        if contexts is None:
            stream.hidden[i] = stream.keep(_layer_output(layer(h, **kw)))
            continue
        context, contexts[i] = contexts[i], None
        out = torch.empty_like(h)
        for piece, result in _replayed(layer, layout, h, context, stream.device,
                                       lambda part, kw=kw: _layer_output(layer(part, **kw))):
            out[piece] = result
        del context
        stream.hidden[i] = stream.keep(out)


@torch.no_grad()
def mlp_inputs(layer: nn.Module, layout: AttentionLayout, stream: Stream, contexts: list | None
               ) -> list[torch.Tensor]:
    """The input of the layer's MLP on every batch of the stream (§17), the attention replayed from
    `contexts` (as installed in `layer`: the compressed attention for the student stream), or run
    when there are none."""
    first = layout.all_projections[layout.mlp_in[0]]
    inputs = []
    for i, (h, kw) in enumerate(stream.batches()):
        if contexts is None:  # an attention kept whole (§15): it runs as it is
            inputs.append(stream.keep(capture_input(layer, first, h, kw)))
            continue
        context = contexts[i]
        x = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        for piece, captured in _replayed(layer, layout, h, context, stream.device,
                                         lambda part, kw=kw: capture_input(layer, first, part, kw)):
            x[piece] = captured
        inputs.append(stream.keep(x))
    return inputs


def mlp_module(layer: nn.Module, layout: AttentionLayout) -> tuple[nn.Module, str]:
    """The layer's MLP block and the name of `W_down` inside it."""
    block, _, down = layout.down.rpartition(".")
    return get_module(layer, block), down


@torch.no_grad()
def down_stats(layer: nn.Module, layout: AttentionLayout, inputs: list[torch.Tensor], device: torch.device,
               compressed_in: dict[str, nn.Module] | None, absolute: bool = False) -> ContextStats:
    """`H_t` (original gate/up) and, if given compressed ones, `H_s` on the same MLP inputs: the
    statistics of `W_down`'s input, as `context_stats` gathers `W_O`'s (§17)."""
    mlp, down = mlp_module(layer, layout)
    stats = ContextStats(teacher=Moments(layout.intermediate, device, absolute))
    if compressed_in is not None:
        stats.student = Moments(layout.intermediate, device, absolute)
        stats.cross = gram_buffer(layout.intermediate, device)
    for x in inputs:
        x = x.to(device)
        h_t = capture_input(mlp, down, x, {})
        stats.teacher.update(h_t)
        if compressed_in is not None:
            with swapped(layer, layout, compressed_in):
                h_s = capture_input(mlp, down, x, {})
            stats.student.update(h_s)
            accumulate_product(stats.cross, h_s, h_t)
            del h_s
        del h_t
    return stats


@torch.no_grad()
def context_stats(
    layer: nn.Module,
    layout: AttentionLayout,
    stream: Stream,
    compressed_qkv: dict[str, nn.Module] | None,
    absolute: bool = False,
    keep: str | None = None,
) -> tuple[ContextStats, list[torch.Tensor] | None]:
    """`A_t` (original Q/K/V) and, if asked, `A_s` (compressed Q/K/V) on the same inputs (§8).

    `keep` ("teacher" or "student") also returns that context per batch, for `propagate` to
    reuse instead of running the attention a third time.
    """
    width = layout.heads * layout.head_dim
    stats = ContextStats(teacher=Moments(width, stream.device, absolute))
    if compressed_qkv is not None:
        stats.student = Moments(width, stream.device, absolute)
        stats.cross = gram_buffer(width, stream.device)
    kept: list[torch.Tensor] | None = None if keep is None else []
    for h, kw in stream.batches():
        a_t = capture_input(layer, layout.o, h, kw)
        stats.teacher.update(a_t)
        a_s = None
        if compressed_qkv is not None:
            with swapped(layer, layout, compressed_qkv):
                a_s = capture_input(layer, layout.o, h, kw)
            stats.student.update(a_s)
            accumulate_product(stats.cross, a_s, a_t)
        if kept is not None:
            kept.append(stream.keep(a_t if keep == "teacher" else a_s))
        del a_s, a_t
    return stats, kept


def _weights(layer: nn.Module, layout: AttentionLayout) -> tuple[dict, dict]:
    """Original attention projection weights in `(in, out)` layout, and their biases."""
    weights, biases = projection_weights(layer, layout)
    return {p: w.detach().T for p, w in weights.items()}, biases


def _modules(groups: list[Group], biases: dict, layout: AttentionLayout, dtype: torch.dtype) -> dict:
    out: dict[str, nn.Module] = {}
    for spec, tensors in groups:
        out.update(build_modules(spec, tensors, biases, layout.head_dim, dtype))
    return out


@torch.no_grad()
def compress_layer(
    layer: nn.Module,
    layout: AttentionLayout,
    method: Method,
    stream: Stream | None,
    compute_dtype: torch.dtype,
    trim: bool = False,
    load_rest: Callable[[], None] | None = None,
) -> tuple[list[Group], dict]:
    """Compress one decoder layer in place and advance the stream through it (§3, §8).

    `load_rest` materialises what only propagation needs (the MLP, see `after_attention`), so
    those weights are not resident during the Q/K/V and W_O math. A unit the plan keeps whole
    (`Method.whole`, §15) keeps its original projections; the report lists it under `whole`.

    The report carries seconds per phase (statistics passes, Q/K/V math, W_O math, propagation),
    so a slow run shows whether the data passes or the factorisations cost the time. `trim`
    returns freed heap to the OS before each of the two activation-heavy passes: glibc otherwise
    keeps the Q/K/V math's buffers resident as fragments under the passes' own peak (a quarter of
    a 1024-wide layer's peak, measured), at a few percent of the run time.
    """
    phases = _PhaseClock()
    if method.scope == "model" and method.per_matrix_mlp and "gateup" in (method.layer_budget or {}):
        method = method.matrix_budgets(layout)  # only then: a wrapping planner (`_Surveying`) stays itself
    device = get_module(layer, layout.q).weight.device
    whole = [unit for unit in ("attention", "mlp") if method.whole(unit)]
    groups, report, replacements, contexts = [], {}, {}, None
    if "attention" not in whole:
        groups, report, replacements, contexts = _compress_attention(layer, layout, method, stream, compute_dtype,
                                                                     trim, phases)
    if load_rest is not None:
        load_rest()
    if method.scope == "model" and "mlp" not in whole:
        if method.stream == "student":  # the MLP's statistics come from the compressed attention (§17)
            place(layer, layout.projections, {p: m.to(device) for p, m in replacements.items()})
        mlp_groups, mlp_report, mlp_replacements = compress_mlp(layer, layout, method, stream, contexts,
                                                                compute_dtype)
        groups += mlp_groups
        report["mlp"] = mlp_report
        replacements.update(mlp_replacements)
        phases.lap("mlp")
    if stream is not None and method.stream == "teacher":
        propagate(layer, stream, layout, contexts)
    place(layer, layout.all_projections, {p: m.to(device) for p, m in replacements.items()})
    if stream is not None and method.stream == "student":
        propagate(layer, stream, layout, contexts)
    phases.lap("propagate")
    report["budget_values"] = method.budget_values(layout)
    if whole:
        report["whole"] = whole
    return groups, {**report, "phase_seconds": phases.seconds()}


def _compress_attention(layer: nn.Module, layout: AttentionLayout, method: Method, stream: Stream | None,
                        compute_dtype: torch.dtype, trim: bool, phases: _PhaseClock
                        ) -> tuple[list[Group], dict, dict, list | None]:
    """Q/K/V and `W_O` of one layer (§3-§8): their groups, report and replacement modules, and the
    attention contexts of the stream's batches when the statistics pass kept them for propagation."""
    weights, biases = _weights(layer, layout)
    x = None
    if method.needs_data:
        x = method.qkv_moments(layout.hidden, stream.device)
        for h, kw in stream.batches():
            x.update(capture_input(layer, layout.q, h, kw))
    phases.lap("statistics")
    qkv_groups, qkv_report = method.qkv({p: weights[p] for p in "qkv"}, x, layout)
    del x  # spent: the context pass below allocates its own Grams
    qkv_modules = _modules(qkv_groups, biases, layout, compute_dtype)
    phases.lap("qkv")
    ctx = contexts = None
    if trim:
        trim_heap()
    if method.needs_data:
        # the context of the stream's own Q/K/V is kept for propagation when the pass computes it
        replay = method.stream if method.stream == "teacher" or method.needs_student_context else None
        ctx, contexts = context_stats(layer, layout, stream, qkv_modules if method.needs_student_context else None,
                                      method.needs_abs_mean, replay if stream is not None else None)
    phases.lap("statistics")
    device = weights["o"].device
    if method.stream == "student":
        # the original projections are spent once the contexts are in (propagation replays the
        # compressed ones): freed before W_O's math, whose argument is then its weight's only holder
        place(layer, layout.projections, {p: m.to(device) for p, m in qkv_modules.items()})
        set_module(layer, layout.o, nn.Identity())  # until its replacement is placed below
        for p in "qkv":
            del weights[p]
    o_group, o_report = method.o(weights.pop("o"), ctx, layout)
    replacements = {**qkv_modules, **_modules([o_group], biases, layout, compute_dtype)}
    del ctx  # the Grams are spent; propagation below is the layer's other memory peak
    if trim:
        trim_heap()
    phases.lap("o")
    return [*qkv_groups, o_group], {**qkv_report, **o_report}, replacements, contexts


@torch.no_grad()
def compress_mlp(layer: nn.Module, layout: AttentionLayout, method: Method, stream: Stream | None,
                 contexts: list | None, compute_dtype: torch.dtype) -> tuple[list[Group], dict, dict]:
    """Gate/up and `W_down` of one layer (§17): groups, report and the modules that replace them.

    The MLP input comes from the stream with the layer's attention replayed (compressed on the
    student stream); gate and up are compressed from its statistics, then `W_down` from those of
    the intermediate activations with original and with compressed gate/up on the same inputs.
    """
    weights, biases = projection_weights(layer, layout, layout.mlp_projections)
    weights = {p: w.detach().T for p, w in weights.items()}
    device = weights["down"].device
    x = inputs = None
    if method.needs_data:
        inputs = mlp_inputs(layer, layout, stream, contexts)
        x = method.qkv_moments(layout.hidden, stream.device)
        for batch in inputs:
            x.update(batch)
    in_groups, in_report = method.mlp_in({p: weights[p] for p in layout.mlp_in}, x, layout)
    del x
    in_modules = _modules(in_groups, biases, layout, compute_dtype)
    ctx = None
    if method.needs_data:
        ctx = down_stats(layer, layout, inputs, stream.device,
                         {p: m.to(device) for p, m in in_modules.items()} if method.needs_student_context else None,
                         method.needs_abs_mean)
    del inputs
    down_group, down_report = method.mlp_out(weights.pop("down"), ctx, layout)
    del ctx
    modules = {**in_modules, **_modules([down_group], biases, layout, compute_dtype)}
    return [*in_groups, down_group], {"in": in_report, "down": down_report}, modules


class _PhaseClock:
    """Wall-clock seconds accumulated per named phase, each lap ending where the previous one did."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self._seconds[name] = self._seconds.get(name, 0.0) + now - self._last
        self._last = now

    def seconds(self) -> dict[str, float]:
        return {name: round(s, 3) for name, s in self._seconds.items()}


MAPPED_BYTES = 1 << 20
"""Allocations from this size up get their own mapping under `map_large_allocations`."""


def map_large_allocations() -> None:
    """Give every allocation of `MAPPED_BYTES` or more its own mapping, unmapped when freed (glibc).

    glibc raises this threshold as large blocks are freed (up to 32 MB), after which the
    factorisations' mid-size buffers come from the heap and linger there as fragments until the
    next trim, under the peak of the step that follows (about 100 MB of a 7B-shaped layer's).
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, MAPPED_BYTES)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def after_attention(layer: nn.Module, layout: AttentionLayout) -> Callable[[str], bool]:
    """Whether a parameter of `layer` (name relative to it) is only used after the attention.

    Those are the Linear weights outside the attention block: the MLP, most of a layer's size
    (352 of 436 MB at a 7B shape in float16). Everything else (norms, the attention block) is
    needed by the statistics passes that run up to the output projection.
    """
    block = layout.o.rpartition(".")[0]

    def after(name: str) -> bool:
        owner = name.rpartition(".")[0]
        inside = owner == block or owner.startswith(block + ".")
        return bool(block) and bool(owner) and not inside and isinstance(layer.get_submodule(owner), nn.Linear)

    return after


def compress_layers(
    model: nn.Module,
    layout: AttentionLayout,
    method: Method,
    stream: Stream | None,
    *,
    device: torch.device,
    weights: WeightSource | None = None,
    start: int = 0,
    compute_dtype: torch.dtype = torch.float32,
    progress: bool = True,
    on_layer: Callable[[LayerResult, nn.Module], None] | None = None,
) -> PipelineResult:
    """Compress decoder layers `start..L-1` in order; the model is modified in place.

    With a weight source, each layer is materialised on `device` just before it is processed and
    released right after `on_layer` has written it out, so only one layer is ever resident. Results
    go to `on_layer` when one is given (nothing is kept), else they are collected in the result.
    """
    t0 = time.perf_counter()
    bounded = weights is not None and not weights.resident  # streamed from disk: keep host memory low
    if bounded:
        map_large_allocations()
    result = PipelineResult()
    layers = decoder_layers(model, layout)
    bar = tqdm(range(start, len(layers)), desc=f"compress {type(method).__name__}", unit="layer",
               initial=start, total=len(layers), disable=not progress)
    for index in bar:
        name = f"{layout.layers_path}.{index}"
        load_rest = None
        if weights is not None:
            later = after_attention(layers[index], layout)
            materialize(model, name, weights, device, compute_dtype, include=lambda p, later=later: not later(p))

            def load_rest(name=name, later=later) -> None:
                materialize(model, name, weights, device, compute_dtype, include=later)

        t1 = time.perf_counter()
        groups, report = compress_layer(layers[index], layout, method.at_layer(index),
                                        None if stream is None else stream.at(index), compute_dtype, trim=bounded,
                                        load_rest=load_rest)
        layer_result = LayerResult(index, groups, report, time.perf_counter() - t1, len(layers))
        if "error_refit" in report:
            bar.set_postfix(err=f"{report['error_refit']:.3f}")
        if on_layer is not None:
            on_layer(layer_result, layers[index])
        else:
            result.layers.append(layer_result)
        if weights is not None:
            release(model, name)
            trim_heap()
    result.seconds = time.perf_counter() - t0
    return result


@torch.no_grad()
def survey_layers(
    model: nn.Module,
    layout: AttentionLayout,
    method: Method,
    stream: Stream,
    *,
    device: torch.device,
    weights: WeightSource | None = None,
    compute_dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> list[dict]:
    """The statistics pass of a model-wide budget (§13): every original layer's `method.survey`.

    The original model's stream goes through the original layers (weights materialised one layer
    at a time, as in `compress_layers`); each layer contributes its Grams, the mean squared norm of
    its input and so its survey, a few curves of floats. `stream` is advanced: pass a copy.
    """
    bounded = weights is not None and not weights.resident
    layers = decoder_layers(model, layout)
    surveys = []
    for index in tqdm(range(len(layers)), desc="survey", unit="layer", disable=not progress):
        name = f"{layout.layers_path}.{index}"
        if weights is not None:
            materialize(model, name, weights, device, compute_dtype)
        layer, at = layers[index], stream.at(index)
        original, _ = _weights(layer, layout)
        x = method.qkv_moments(layout.hidden, stream.device)
        energy, rows = 0.0, 0
        for h, kw in at.batches():
            x.update(capture_input(layer, layout.q, h, kw))
            energy += float(h.double().pow(2).sum())
            rows += h.numel() // h.shape[-1]
        ctx, contexts = context_stats(layer, layout, at, None, keep="teacher")
        mlp = None
        if method.scope == "model":  # the MLP's statistics on the same original stream (§17)
            mlp_weights, _ = projection_weights(layer, layout, layout.mlp_projections)
            original.update({p: w.detach().T for p, w in mlp_weights.items()})
            inputs = mlp_inputs(layer, layout, at, contexts)
            x_m = Moments(layout.hidden, stream.device)
            for batch in inputs:
                x_m.update(batch)
            mlp = (x_m, down_stats(layer, layout, inputs, stream.device, None))
            del inputs
        surveys.append(method.survey(original, x, ctx, energy / max(rows, 1), layout, mlp))
        del x, ctx, mlp
        propagate(layer, at, layout, contexts)
        if weights is not None:
            release(model, name)
            if bounded:
                trim_heap()
    return surveys


def planned(method: Method, surveys: list[dict], layout: AttentionLayout) -> Method:
    """`method` with the per-layer budgets its `plan` makes of the surveys."""
    return dataclasses.replace(method, budgets=tuple(method.plan(surveys, layout)))

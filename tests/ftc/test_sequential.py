"""Every ablation takes effect, and the sequential metric is the one of ftc-method.md §3 and §8.

The Grams a method receives are recorded during a real pipeline run and compared with Grams
recomputed from scratch on a model assembled by hand: layers before `l` compressed (taken from
the finished run), layer `l` and later original.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ftc.compression.gradients import with_loss_metric
from ftc.compression.methods import SINK_WEIGHT, make_method
from ftc.compression.pipeline import layer_inputs, survey_layers
from ftc.models.arch import decoder_layers, get_module, layout_of, set_module
from ftc.models.weights import ModuleSource
from ftc.options import ABLATIONS, MLP_ABLATIONS
from tests.support.pipeline import compress_model
from tests.support.tiny import tiny_model

D = torch.float64
CALIB = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))


class Recorder:
    """Wraps a method and keeps what the pipeline hands it: the Q/K/V Gram and the W_O contexts."""

    def __init__(self, method) -> None:
        self.method = method
        self.grams: list[torch.Tensor] = []
        self.contexts: list = []

    def __getattr__(self, name: str):
        return getattr(self.method, name)

    def at_layer(self, index: int):
        assert self.method.budgets is None  # uniform budgets: only the loss metrics' output metrics vary
        self.layer = self.method.at_layer(index)
        return self

    def qkv(self, weights, x, layout):
        self.grams.append(x.gram.clone())
        return self.layer.qkv(weights, x, layout)

    def o(self, w_o, ctx, layout):
        self.contexts.append(copy.deepcopy(ctx))  # FTC's `o` takes the Grams over and spends them
        return self.layer.o(w_o, ctx, layout)


def _run(ablations=(), layers: int = 2, ratio: float = 0.4, scope: str = "attention"):
    model = tiny_model("gqa", layers=layers)
    layout = layout_of(model.config)
    method = make_method("ftc", ratio, torch.float32, ablations, scope=scope)
    if method.loss_metric:  # attached before the wrapper, which `compress_model` cannot replace
        method = with_loss_metric(method, ModuleSource(model), layout, CALIB, torch.device("cpu"), progress=False)
    method = Recorder(method)
    compress_model(model, layout, method, CALIB, device=torch.device("cpu"), batch_size=4, progress=False)
    return model, layout, method


def _inputs(model, layout, index: int, name: str) -> torch.Tensor:
    """Float64 input of submodule `name` of decoder layer `index` over the calibration set,
    `(sequences, positions, width)`."""
    seen: list[torch.Tensor] = []
    module = get_module(decoder_layers(model, layout)[index], name)
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(input_ids=CALIB, use_cache=False)
    finally:
        handle.remove()
    return seen[0].to(D)


def _gram(x: torch.Tensor, other: torch.Tensor | None = None, first_weight: int = 1) -> torch.Tensor:
    """`sum_t w_t x_t^T y_t / sum_t w_t` over all positions, `w_t = first_weight` at each sequence's first."""
    w = torch.ones(x.shape[:2], dtype=D)
    w[:, 0] = first_weight
    rows, w = x.reshape(-1, x.shape[-1]), w.reshape(-1, 1)
    return (w * rows).T @ (rows if other is None else other.reshape(rows.shape)) / w.sum()


def _partly_compressed(compressed, layout, layers: int, below: int, qkv_of: int | None = None):
    """The original model with the projections of layers `< below` (and Q/K/V of `qkv_of`) swapped in."""
    model = tiny_model("gqa", layers=layers)
    done, fresh = decoder_layers(compressed, layout), decoder_layers(model, layout)
    for index in range(below):
        for name in layout.projections.values():
            set_module(fresh[index], name, get_module(done[index], name))
    if qkv_of is not None:
        for p in "qkv":
            name = layout.projections[p]
            set_module(fresh[qkv_of], name, get_module(done[qkv_of], name))
    return model


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).norm() / b.norm()) < 1e-5)


@pytest.fixture(scope="module")
def full_logits() -> torch.Tensor:
    with torch.no_grad():
        return _run()[0](PROBE).logits


@pytest.mark.parametrize("ablation", ABLATIONS)
def test_every_ablation_changes_the_compressed_model(ablation, full_logits):
    if ablation in MLP_ABLATIONS:  # they change how the MLP is compressed: set against the whole model's run
        ablated, _, method = _run((ablation,), scope="model")
        with torch.no_grad():
            a, b = _run(scope="model")[0](PROBE).logits, ablated(PROBE).logits
    else:
        ablated, _, method = _run((ablation,))
        with torch.no_grad():
            a, b = full_logits, ablated(PROBE).logits
    assert (a - b).norm() / a.norm() > 1e-4, f"ablation {ablation} left the output unchanged"
    if ablation == "no_sequential":
        assert method.stream == "teacher"


def test_the_qkv_gram_of_each_layer_comes_from_the_partly_compressed_model():
    layers = 3
    compressed, layout, method = _run(layers=layers)
    original = tiny_model("gqa", layers=layers)
    for index in range(1, layers):
        x = _inputs(_partly_compressed(compressed, layout, layers, index), layout, index, layout.q)
        assert _close(method.grams[index], _gram(x, first_weight=SINK_WEIGHT)), f"layer {index}: not the student Gram"
        assert not _close(method.grams[index], _gram(x)), f"layer {index}: the first position is not weighted"
        unshifted = _inputs(original, layout, index, layout.q)
        assert not _close(method.grams[index], _gram(unshifted, first_weight=SINK_WEIGHT))


def test_no_sequential_takes_the_qkv_gram_from_the_original_model():
    layers = 3
    _, layout, method = _run(("no_sequential",), layers=layers)
    original = tiny_model("gqa", layers=layers)
    for index in range(layers):
        assert _close(method.grams[index], _gram(_inputs(original, layout, index, layout.q), first_weight=SINK_WEIGHT))


def test_no_sink_counts_the_first_position_once():
    layers = 2
    compressed, layout, method = _run(("no_sink",), layers=layers)
    x = _inputs(_partly_compressed(compressed, layout, layers, 1), layout, 1, layout.q)
    assert _close(method.grams[1], _gram(x))


def test_the_wo_contexts_come_from_the_student_input_with_compressed_and_original_qkv():
    layers = 3
    compressed, layout, method = _run(layers=layers)
    original = tiny_model("gqa", layers=layers)
    for index in range(1, layers):
        ctx = method.contexts[index]
        a_t = _inputs(_partly_compressed(compressed, layout, layers, index), layout, index, layout.o)
        a_s = _inputs(_partly_compressed(compressed, layout, layers, index, qkv_of=index), layout, index, layout.o)
        assert _close(ctx.teacher.gram, _gram(a_t)), f"layer {index}: teacher context"
        assert _close(ctx.student.gram, _gram(a_s)), f"layer {index}: student context"
        assert _close(ctx.cross / ctx.student.count, _gram(a_s, a_t)), f"layer {index}: cross context"
        assert not _close(ctx.teacher.gram, _gram(_inputs(original, layout, index, layout.o)))
        assert not _close(ctx.student.gram, ctx.teacher.gram)


def test_the_sink_weight_buys_the_first_position_a_more_accurate_qkv():
    """The assembled effect of the weight: layer 0's compressed Q/K/V (whose input is the same in
    every model) reproduce the first position of each calibration sequence better than `no_sink`'s."""
    original = tiny_model("gqa", layers=2)
    layout = layout_of(original.config)
    x = _inputs(original, layout, 0, layout.q).float()

    def first_position_error(model) -> float:
        layer, reference = decoder_layers(model, layout)[0], decoder_layers(original, layout)[0]
        with torch.no_grad():
            errors = [get_module(layer, name)(x)[:, 0] - get_module(reference, name)(x)[:, 0]
                      for name in (layout.projections[p] for p in "qkv")]
        return float(torch.cat(errors, -1).norm())

    weighted, plain = first_position_error(_run()[0]), first_position_error(_run(("no_sink",))[0])
    assert weighted < 0.7 * plain, (weighted, plain)


def test_the_global_plan_surveys_in_the_metric_compression_uses():
    """`--allocation global` plans from each original layer's Q/K/V Gram: weighted at the sink
    like the Gram the layer is then compressed in, and once per row under `no_sink`."""
    layers = 2
    original = tiny_model("gqa", layers=layers)
    layout = layout_of(original.config)
    for ablations, weight in (((), SINK_WEIGHT), (("no_sink",), 1)):
        method = make_method("ftc", 0.4, torch.float32, ablations, "global")
        stream = layer_inputs(original, layout, CALIB, 4, torch.device("cpu"))
        seen: list[torch.Tensor] = []

        def recorded(w, x, *rest, seen=seen, survey=method.survey):
            seen.append(x.gram.clone())
            return survey(w, x, *rest)

        method.survey = recorded
        survey_layers(original, layout, method, stream, device=torch.device("cpu"), progress=False)
        for index in range(layers):
            assert _close(seen[index], _gram(_inputs(original, layout, index, layout.q), first_weight=weight)), (
                ablations, index)

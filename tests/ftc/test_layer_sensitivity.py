"""`--allocation sensitivity` (ftc-method.md §15): each layer's attention compressed alone by the
method itself, the KL divergence it causes, and the plan made on those curves."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from ftc.compression import sensitivity
from ftc.compression.compress import CompressOptions, compress
from ftc.compression.methods import make_method
from ftc.compression.sensitivity import (
    CACHE_ENV,
    Sensitivity,
    UnitCurve,
    _Reference,
    gains_plan,
    layer_plan,
    layer_sensitivities,
)
from ftc.models.arch import decoder_layers, get_module, layout_of, set_module
from ftc.numerics.allocation import Curve, choose
from ftc.options import ASVD_SENSITIVITY_SEQUENCES, LAYER_RATIO_CANDIDATES, PLAN_REFERENCE_RATIO, InputError
from tests.ftc.test_asvd_search import BATCH, CPU, _calibration, _confident
from tests.ftc.test_registry import default
from tests.support.pipeline import compress_model
from tests.support.tiny import tiny_model


def _divergence(reference, model, ids: torch.Tensor) -> float:
    """Mean KL per token of `model`'s next-token distribution from `reference`'s, by the definition."""
    with torch.no_grad():
        p = F.log_softmax(reference(ids).logits.double(), -1)
        q = F.log_softmax(model(ids).logits.double(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize(("layout_name", "method"), [("gqa", "ftc"), ("phi3", "ftc"), ("gemma3", "cp")])
def test_each_entry_is_the_divergence_with_that_layer_alone_compressed(layout_name, method):
    """Entry (l, p) against an independent route: the whole model compressed at p on the original
    stream (`no_sequential`, so layer l's result does not depend on the layers before it), its layer
    l attention alone put into the original model, and the KL computed from full forwards."""
    model = _confident(layout_name)
    layout = layout_of(model.config)
    calib = _calibration(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ratios = (0.2, 0.6)
    planner = make_method(method, 0.4, torch.float32, allocation="sensitivity")
    entries = layer_sensitivities(planner, model, layout, calib, batch_size=BATCH, progress=False, ratios=ratios)
    assert [(e.ratio, e.layer, e.proj) for e in entries] == list(itertools.product(ratios, range(3), ["attention"]))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the search must leave the model as it was"
    ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
    block = layout.o.rpartition(".")[0]
    for ratio in ratios:
        compressed = copy.deepcopy(model)
        ablations = ("no_sequential",) if method == "ftc" else ()
        probe = make_method(method, ratio, torch.float32, ablations)
        if method == "cp":  # CP takes no ablation flags by name; the same stream, set as the search sets it
            probe = dataclasses.replace(probe, ablations=frozenset({"no_sequential"}))
        compress_model(compressed, layout, probe, calib, device=CPU, batch_size=BATCH)
        for index in range(3):
            alone = copy.deepcopy(model)
            set_module(decoder_layers(alone, layout)[index], block,
                       get_module(decoder_layers(compressed, layout)[index], block))
            [entry] = [e for e in entries if (e.layer, e.ratio) == (index, ratio)]
            assert entry.loss == pytest.approx(_divergence(model, alone, ids), rel=1e-4, abs=1e-6), entry
    assert min(e.loss for e in entries if e.ratio == 0.2) > min(e.loss for e in entries if e.ratio == 0.6)


def test_the_plan_chooses_along_the_divergence_curves_within_the_budget():
    """On a worked example: each layer's curve is its divergence at each candidate ratio, costing that
    ratio of its Q/K/V tensor and of its `W_O`; the plan is the allocator's choice on those curves,
    spends at most rho of the attention, and gives layer 1, ten times as sensitive, more."""
    layout = layout_of(_confident("gqa").config)
    qkv, o = layout.qkv_params, layout.o_params
    ratios = (0.1, 0.3, 0.6)
    scale = {0: 1.0, 1: 10.0, 2: 1.0}
    entries = [Sensitivity(i, "attention", r, scale[i] * (1 - r) ** 2) for i in range(3) for r in ratios]
    curves = [Curve(str(i), tuple(int(r * qkv) + int(r * o) for r in ratios),
                    tuple(scale[i] * (1 - r) ** 2 for r in ratios)) for i in range(3)]
    for rho in (0.1, 0.2, 0.3, 0.45, 0.6):
        plan = layer_plan(entries, layout, 3, rho)
        assert sum(b["qkv"] + b["o"] for b in plan) <= rho * 3 * (qkv + o)
        expected = [ratios[i] for i in choose(curves, int(rho * 3 * (qkv + o)))]
        assert plan == [{"qkv": int(r * qkv), "o": int(r * o)} for r in expected]
        if 0.1 < rho < 0.6:
            assert expected[1] > expected[0] and expected[1] > expected[2]
    with pytest.raises(InputError, match=r"--ratio to at least 0\.1"):
        layer_plan(entries, layout, 3, 0.05)


@pytest.mark.parametrize("method", ["ftc", "cp"])
def test_the_sensitivity_allocation_plans_from_its_own_kept_list(method, tiny_folder, tmp_path, monkeypatch):
    """The manifest's budgets are `gains_plan` of the method's own streamed layer list, kept in the
    cache and read back at a second ratio without measuring again; the whole stays within rho."""
    folder = tiny_folder("gqa", layers=3)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fields = dict(model=str(folder), device="cpu", calib_samples=6, seq_len=32, dtype="float32", batch_size=4,
                  method=method, allocation="sensitivity")
    first = compress(CompressOptions(ratio=0.4, **fields), tmp_path / "a", progress=False)
    [kept] = (tmp_path / "cache" / "layer-plan").iterdir()
    curves = [UnitCurve(**{k: tuple(v) if isinstance(v, list) else v for k, v in e.items()})
              for e in json.loads(kept.read_text())["entries"]]
    assert [(c.layer, c.unit) for c in curves] == [(i, "attention") for i in range(3)]
    assert all(c.ratios == LAYER_RATIO_CANDIDATES for c in curves)
    layout = layout_of(tiny_model("gqa", layers=3).config)
    assert first["allocation"] == {"kind": "sensitivity",
                                   "layer_budgets": gains_plan(curves, layout, 3, 0.4, "attention")}

    def measure(*args, **kwargs):
        raise AssertionError("the layer list was measured a second time")

    monkeypatch.setattr(sensitivity, "layer_gains", measure)
    second = compress(CompressOptions(ratio=0.2, **fields), tmp_path / "b", progress=False)
    assert second["allocation"]["layer_budgets"] == gains_plan(curves, layout, 3, 0.2, "attention")
    for manifest in (first, second):
        storage = manifest["storage"]
        assert storage["qkv_values_used"] + storage["o_values_used"] <= storage["attention_budget_values"]


class _Conversions(torch.overrides.TorchFunctionMode):
    """The largest float32 tensor converted from a 16-bit one while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor) and out.dtype == torch.float32
                and source.dtype in (torch.float16, torch.bfloat16)):
            self.largest = max(self.largest, out.numel())
        return out


@pytest.mark.parametrize(("affine", "dtype"), [(True, torch.float32), (False, torch.float32),
                                               (True, torch.bfloat16)])
def test_the_reference_reads_the_kl_divergence_by_its_definition(affine, dtype, monkeypatch):
    """`_Reference` (§15) against `sum p0 (log p0 - log p)` of the head in float64, block by block: with
    an affine head from the Bregman form (the head inputs, `W^T p0` and the log-partition), otherwise
    from the spilled log-probabilities. Logits near 20, as a real head's. A 16-bit head, as a streamed
    16-bit checkpoint materialises it (`BlockwiseLinear`), is never converted to float32 whole: on a 7B
    shape that copy is 0.5 GB, over the list's memory bound (`benchmarks/results/memory.md`)."""
    import ftc.models.weights

    monkeypatch.setattr(ftc.models.weights, "UPCAST_ROWS", 7)  # several blocks and a ragged last one
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 16, generator=generator) * 3)
        head.bias.copy_(torch.randn(300, generator=generator) + 20)
    if dtype != torch.float32:
        head.weight = torch.nn.Parameter(head.weight.detach().to(dtype), requires_grad=False)
        head.__class__ = ftc.models.weights.BlockwiseLinear
    inputs = [torch.randn(n, 16, generator=generator) for n in (5, 5, 2)]
    moved = [x + 0.05 * torch.randn(x.shape, generator=generator) for x in inputs]

    def blocks(xs):
        with torch.no_grad():
            return iter([(x if affine else None, head(x)) for x in xs])

    with _Conversions() as conversions:
        reference = _Reference(blocks(inputs), head)
        divergence = reference.divergence(blocks(moved))
    assert conversions.largest <= 7 * 16
    assert reference.affine is affine
    exact = torch.nn.Linear(16, 300).double()
    with torch.no_grad():
        exact.weight.copy_(head.weight.double())  # the 16-bit head's own values
        exact.bias.copy_(head.bias.double())
        p0 = F.log_softmax(exact(torch.cat(inputs).double()), -1)
        p = F.log_softmax(exact(torch.cat(moved).double()), -1)
    expected = float((p0.exp() * (p0 - p)).sum(-1).mean())
    assert expected > 1e-2
    # float32 logits near 20 round by about 1e-6 each: 1e-4 of this divergence, by either route
    assert divergence == pytest.approx(expected, rel=1e-4)
    assert reference.divergence(blocks(inputs)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(("layout_name", "scope", "capped"),
                         [("gqa", "attention", False), ("gemma3", "model", False), ("phi3", "model", False),
                          ("gemma3", "attention", True)])
def test_each_streamed_divergence_is_that_of_the_unit_alone_compressed(layout_name, scope, capped, monkeypatch):
    """The streamed list (§15): unit (l, attention|mlp) holds the KL divergence of the model with only
    that unit of layer l compressed at the reference ratio, measured through an independent route (the
    whole model compressed at that ratio on the original stream, the unit put into a copy of the
    original model, full forwards), and its predicted errors fall as the ratio grows. The list reads
    the logits 5 positions at a time here (a last block of 2), the route whole sequences. `capped`
    soft-caps the logits (as Gemma 2 does): the head is then not affine, and the reference keeps the
    log-probabilities (`_Reference`)."""
    from ftc.models.weights import ModuleSource

    monkeypatch.setattr(sensitivity, "PLAN_LOGIT_POSITIONS", 5)
    references = []
    monkeypatch.setattr(sensitivity, "_Reference", lambda *args: references.append(_Reference(*args)) or references[-1])

    model = _confident(layout_name)
    if capped:
        model.config.final_logit_softcapping = 5.0
    layout = layout_of(model.config)
    calib = _calibration(model)
    planner = make_method("ftc", 0.4, torch.float32, allocation="sensitivity", scope=scope)
    curves = sensitivity.layer_gains(planner, ModuleSource(model), layout, calib, device=CPU, batch_size=BATCH,
                                     progress=False)
    units = ["attention", "mlp"] if scope == "model" else ["attention"]
    assert [(c.layer, c.unit) for c in curves] == list(itertools.product(range(3), units))
    assert [r.affine for r in references] == [not capped]
    compressed = copy.deepcopy(model)
    probe = make_method("ftc", PLAN_REFERENCE_RATIO, torch.float32, ("no_sequential",), scope=scope)
    compress_model(compressed, layout, probe, calib, device=CPU, batch_size=BATCH)
    names = {"attention": layout.projections.values(), "mlp": layout.mlp_projections.values()}
    ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
    for curve in curves:
        alone = copy.deepcopy(model)
        for name in set(names[curve.unit]):
            set_module(decoder_layers(alone, layout)[curve.layer], name,
                       get_module(decoder_layers(compressed, layout)[curve.layer], name))
        assert curve.divergence == pytest.approx(_divergence(model, alone, ids), rel=2e-3, abs=2e-7), curve
        assert list(curve.errors) == sorted(curve.errors, reverse=True)
        assert curve.reference_error == curve.errors[curve.ratios.index(PLAN_REFERENCE_RATIO)]


@pytest.mark.parametrize("part", ["tensor", "matrix"])
def test_the_survey_frees_the_whitening_before_it_factorises(part, monkeypatch):
    """The survey's curves (§15) free the whitening's Cholesky factor before the full HOSVD (a tensor)
    or the SVD (a matrix): at width 4096 it is 134 MB beside them, at the layer list's peak on a 7B
    shape (`benchmarks/results/memory.md`). The curves are still those of the whitened operand."""
    import gc
    import weakref

    from ftc.numerics import allocation, metric
    from ftc.numerics.metric import Whitening

    made, alive = [], []
    from_gram = Whitening.from_gram.__func__

    def tracked(cls, *args, **kwargs):
        whitening = from_gram(cls, *args, **kwargs)
        made.append(weakref.ref(whitening.chol))  # the factor, released or dropped with its whitening
        return whitening

    def checked(factorise):
        def run(*args, **kwargs):
            gc.collect()
            alive.append(sum(ref() is not None for ref in made))
            return factorise(*args, **kwargs)
        return run

    monkeypatch.setattr(metric.Whitening, "from_gram", classmethod(tracked))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, generator=gen, dtype=torch.float64)
    gram = x.T @ x / 64
    survey = sensitivity._Surveying(make_method("ftc", 0.4, torch.float32), (0.2, 0.5))
    if part == "tensor":
        monkeypatch.setattr(allocation, "hosvd", checked(allocation.hosvd))
        tensor = torch.randn(3, 12, 4, generator=gen)
        curve = survey._tensor_curve(tensor, gram, 3 * 12 * 4, None)
        expected = allocation.tucker_curve(tensor, Whitening.from_gram(gram), [28, 72])
    else:
        monkeypatch.setattr(torch.linalg, "svdvals", checked(torch.linalg.svdvals))
        w = torch.randn(12, 6, generator=gen)
        curve = survey._matrix_curve(w, gram)
        spectrum = torch.linalg.svdvals(Whitening.from_gram(gram).apply(w.double())).pow(2)
        tail = 1 - spectrum.cumsum(0) / spectrum.sum()
        expected = [float(tail[max(1, int(r * 72) // 18) - 1]) for r in (0.2, 0.5)]
    assert alive[0] == 0
    assert curve == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_the_streamed_list_holds_one_layer_and_no_head_while_a_layer_is_compressed(monkeypatch):
    """The list's memory bound (§15, `benchmarks/memory.py`): at most one decoder layer materialised at
    any time, the layer's MLP still unloaded when its compression starts, the output head
    materialised only outside the compressions (on a 7B shape each of them is 0.4 GB of the peak),
    and the probe's sequences run through a layer `PLAN_PROBE_BATCH` at a time (their MLP
    activations, 350 MB on a 7B shape for all four at once)."""
    from ftc.compression import pipeline
    from ftc.models.weights import ModuleSource

    model = _confident("gqa")
    layout = layout_of(model.config)
    resident: set[str] = set()
    most_layers, seen = 0, []
    materialize, release, compress_layer = sensitivity.materialize, sensitivity.release, pipeline.compress_layer

    def tracked_materialize(skeleton, name, *args, **kwargs):
        nonlocal most_layers
        materialize(skeleton, name, *args, **kwargs)
        resident.add(name)
        most_layers = max(most_layers, sum(n.startswith(layout.layers_path + ".") for n in resident))

    def tracked_release(skeleton, name):
        release(skeleton, name)
        resident.discard(name)

    def tracked_compress(layer, *args, **kwargs):
        seen.append((set(resident), get_module(layer, layout.down).weight.device.type))
        return compress_layer(layer, *args, **kwargs)

    through, probe_rows = sensitivity._through, []

    def tracked_through(model, layout, weights, probe, hidden, *args, **kwargs):
        probe_rows.extend(h.shape[0] for h in hidden)
        return through(model, layout, weights, probe, hidden, *args, **kwargs)

    monkeypatch.setattr(sensitivity, "materialize", tracked_materialize)
    monkeypatch.setattr(sensitivity, "release", tracked_release)
    monkeypatch.setattr(sensitivity, "_through", tracked_through)
    monkeypatch.setattr(pipeline, "compress_layer", tracked_compress)
    planner = make_method("ftc", 0.4, torch.float32, allocation="sensitivity", scope="model")
    sensitivity.layer_gains(planner, ModuleSource(model), layout, _calibration(model), device=CPU, batch_size=BATCH,
                            progress=False)
    assert most_layers == 1
    assert set(probe_rows) == {sensitivity.PLAN_PROBE_BATCH} and sensitivity.PLAN_PROBE_BATCH < BATCH
    assert len(seen) == 3
    for index, (names, mlp_device) in enumerate(seen):
        assert names == {f"{layout.layers_path}.{index}"}, names  # no head, no other layer
        assert mlp_device == "meta"  # loaded after the attention's math


def _values(budgets: dict) -> int:
    """Stored values a layer's budgets grant, the list of whole units aside."""
    return sum(v for part, v in budgets.items() if part != "whole")


def test_the_streamed_plan_chooses_along_the_scaled_curves_within_the_budget():
    """`gains_plan` on a worked example: each unit's curve is its predicted error scaled to its measured
    divergence; the plan is the allocator's choice on those curves within rho of what the scope
    compresses, a ten times more sensitive unit getting more."""
    layout = layout_of(_confident("gqa").config)
    params = layout.part_params("model")
    ratios = (0.1, 0.3, 0.6)
    errors = tuple((1 - r) ** 2 for r in ratios)
    gain = {(0, "attention"): 1.0, (0, "mlp"): 10.0, (1, "attention"): 1.0, (1, "mlp"): 1.0}
    curves = [UnitCurve(layer, unit, ratios, errors, g * errors[1], errors[1]) for (layer, unit), g in gain.items()]
    total = sum(params.values())
    for rho in (0.2, 0.3, 0.45):
        plan = gains_plan(curves, layout, 2, rho, "model")
        assert sum(_values(b) for b in plan) <= rho * 2 * total
        assert plan[0]["gateup"] / params["gateup"] >= plan[1]["gateup"] / params["gateup"]
        for layer in plan:  # a unit's ratio applies to each of its parts
            assert layer["qkv"] / params["qkv"] == pytest.approx(layer["o"] / params["o"], abs=1e-3)
    with pytest.raises(InputError, match=r"--ratio to at least 0\.1"):
        gains_plan(curves, layout, 2, 0.05, "model")


def test_the_streamed_plan_keeps_a_unit_whole_where_its_values_buy_the_most(monkeypatch):
    """With `PLAN_WHOLE_UNITS` a unit may stay whole (its full size, no divergence): at keep 0.8 a unit
    a hundred times more sensitive than the rest is kept whole, listed under its layer's `"whole"`,
    with its parts' full sizes; the plan stays within the budget. Without it no unit is whole."""
    layout = layout_of(_confident("gqa").config)
    params = layout.part_params("model")
    ratios = LAYER_RATIO_CANDIDATES
    errors = tuple((1 - r) ** 2 for r in ratios)
    gain = {(0, "attention"): 1.0, (0, "mlp"): 100.0, (1, "attention"): 1.0, (1, "mlp"): 1.0}
    curves = [UnitCurve(layer, unit, ratios, errors, g * errors[1], errors[1]) for (layer, unit), g in gain.items()]
    plan = gains_plan(curves, layout, 2, 0.8, "model")
    assert plan[0]["whole"] == ["mlp"] and "whole" not in plan[1]
    assert (plan[0]["gateup"], plan[0]["down"]) == (params["gateup"], params["down"])
    assert sum(_values(b) for b in plan) <= 0.8 * 2 * sum(params.values())
    monkeypatch.setattr(sensitivity, "PLAN_WHOLE_UNITS", False)
    assert not any("whole" in layer for layer in gains_plan(curves, layout, 2, 0.8, "model"))


@pytest.mark.parametrize("method", ["ftc", "cp"])
def test_the_manifest_records_the_layer_search_only_where_it_plans(method):
    planned = make_method(method, 0.4, torch.float16, allocation="sensitivity").choices()["layer_sensitivity"]
    assert planned["ratio_candidates"] == list(LAYER_RATIO_CANDIDATES)
    assert planned["ratio_candidates"] == list(default(layer_sensitivities, "ratios"))
    assert planned["sequences"] == ASVD_SENSITIVITY_SEQUENCES
    assert "layer_sensitivity" not in make_method(method, 0.4, torch.float16).choices()


def test_dense_cores_plan_from_a_list_of_their_own(tiny_folder, tmp_path, monkeypatch):
    """`--ablate dense_core` (§9) changes every fit the layer list measures and predicts, so its list
    is kept under its own name: a default list of the same model and calibration is not reused."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fields = dict(model=str(tiny_folder("gqa", layers=2)), device="cpu", calib_samples=4, seq_len=32,
                  dtype="float32", batch_size=4, allocation="sensitivity", ratio=0.4)
    compress(CompressOptions(**fields), tmp_path / "a", progress=False)
    compress(CompressOptions(**fields, ablate=("dense_core",)), tmp_path / "b", progress=False)
    lists = [[tuple(e["errors"]) for e in json.loads(p.read_text())["entries"]]
             for p in (tmp_path / "cache" / "layer-plan").iterdir()]
    assert len(lists) == 2 and lists[0] != lists[1]

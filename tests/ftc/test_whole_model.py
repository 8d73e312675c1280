"""Whole-model compression (scope `model`, ftc-method.md §17): the MLP through FTC's machinery.

Definitions first (the joint gate/up tensor within its budget, the calibrated `W_down` against a
textbook solve, the MLP statistics taken from the compressed model's stream), then the assembled
path on every family: compress, reload, export.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from safetensors import safe_open

from ftc.compression.compress import CompressOptions, compress, part_of
from ftc.compression.methods import ANCHOR, SINK_WEIGHT, ContextStats, make_method
from ftc.models.arch import decoder_layers, get_module, layout_of, set_module
from ftc.numerics.metric import Moments
from ftc.options import InputError
from ftc.runtime.artifact import load_artifact
from ftc.runtime.hf.modeling_ftc import runtime_forms
from tests.support.pipeline import compress_model
from tests.support.tiny import LAYOUTS, tiny_model

D = torch.float64
CALIB = torch.randint(0, 256, (8, 48), generator=torch.Generator().manual_seed(1))
PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))


class Recorder:
    """Wraps a method and keeps the MLP statistics the pipeline hands it."""

    def __init__(self, method) -> None:
        self.method = method
        self.mlp_grams: list[torch.Tensor] = []
        self.down_contexts: list[ContextStats] = []

    def __getattr__(self, name: str):
        return getattr(self.method, name)

    def at_layer(self, index: int):
        return self

    def mlp_in(self, weights, x, layout):
        self.mlp_grams.append(x.gram.clone())
        return self.method.mlp_in(weights, x, layout)

    def mlp_out(self, w_down, ctx, layout):
        self.down_contexts.append(copy.deepcopy(ctx))  # FTC's `mlp_out` takes the Grams over
        return self.method.mlp_out(w_down, ctx, layout)


def _inputs(model, layout, index: int, name: str) -> torch.Tensor:
    """Float64 input of submodule `name` of decoder layer `index` over the calibration set."""
    seen: list[torch.Tensor] = []
    handle = get_module(decoder_layers(model, layout)[index], name).register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(input_ids=CALIB, use_cache=False)
    finally:
        handle.remove()
    return seen[0].to(D)


def _gram(x: torch.Tensor, other: torch.Tensor | None = None, first_weight: int = 1) -> torch.Tensor:
    w = torch.ones(x.shape[:2], dtype=D)
    w[:, 0] = first_weight
    rows, w = x.reshape(-1, x.shape[-1]), w.reshape(-1, 1)
    return (w * rows).T @ (rows if other is None else other.reshape(rows.shape)) / w.sum()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).norm() / b.norm()) < 1e-5)


def _student(compressed, layout, layers: int, below: int, attention_of: int | None = None, mlp_in_of=None):
    """The original model with every projection of layers `< below` swapped in from `compressed`, and
    the attention (and gate/up) of layer `attention_of` (`mlp_in_of`)."""
    model = tiny_model("gqa", layers=layers)
    done, fresh = decoder_layers(compressed, layout), decoder_layers(model, layout)
    names = layout.all_projections
    for index in range(layers):
        keys = list(names) if index < below else []
        if index == attention_of:
            keys += ["q", "k", "v", "o"]
        if index == mlp_in_of:
            keys += list(layout.mlp_in)
        for key in keys:
            set_module(fresh[index], names[key], get_module(done[index], names[key]))
    return model


def test_the_mlp_statistics_come_from_the_compressed_models_stream():
    """§17: gate/up's Gram is the MLP input of the model compressed so far (this layer's attention
    included, sink-weighted as §3's); `W_down`'s contexts are the intermediate activations of the
    original and of the compressed gate/up on that same input."""
    layers = 3
    model = tiny_model("gqa", layers=layers)
    layout = layout_of(model.config)
    method = Recorder(make_method("ftc", 0.4, torch.float32, scope="model"))
    compress_model(model, layout, method, CALIB, device=torch.device("cpu"), batch_size=4)
    original = tiny_model("gqa", layers=layers)
    for index in range(1, layers):
        student = _student(model, layout, layers, index, attention_of=index)
        x = _inputs(student, layout, index, layout.gate)
        assert _close(method.mlp_grams[index], _gram(x, first_weight=SINK_WEIGHT)), f"layer {index}: MLP input"
        assert not _close(method.mlp_grams[index], _gram(_inputs(original, layout, index, layout.gate),
                                                        first_weight=SINK_WEIGHT))
        h_t = _inputs(student, layout, index, layout.down)
        h_s = _inputs(_student(model, layout, layers, index, attention_of=index, mlp_in_of=index), layout, index,
                      layout.down)
        ctx = method.down_contexts[index]
        assert _close(ctx.teacher.gram, _gram(h_t)) and _close(ctx.student.gram, _gram(h_s))
        assert _close(ctx.cross / ctx.student.count, _gram(h_s, h_t))


def test_the_down_projection_solves_the_anchored_calibration():
    """At full rank `W_down` is the textbook least-squares solution of
    `min ||H_s W - H_t W_down||^2 + a ||H_t (W - W_down)||^2` (§8 applied to the MLP, §17)."""
    layout = layout_of(tiny_model("gqa", layers=1).config)
    g = torch.Generator().manual_seed(0)
    intermediate, hidden = layout.intermediate, layout.hidden
    h_t = torch.randn(600, intermediate, generator=g, dtype=D)
    h_s = h_t + 0.3 * torch.randn(600, intermediate, generator=g, dtype=D)
    w = torch.randn(intermediate, hidden, generator=g, dtype=D)
    ctx = ContextStats(teacher=Moments(intermediate), student=Moments(intermediate),
                       cross=h_s.T @ h_t)
    ctx.teacher.update(h_t)
    ctx.student.update(h_s)
    full = {"down": min(intermediate, hidden) * (intermediate + hidden)}  # rank min(I, d): no truncation
    method = make_method("ftc", 1.0, torch.float64, scope="model")
    method = type(method)(1.0, torch.float64, scope="model", layer_budget=full)
    (spec, tensors), _ = method.mlp_out(w, ctx, layout)
    got = tensors["A"] @ tensors["B"]
    stacked = torch.cat([h_s, math.sqrt(ANCHOR) * h_t])
    target = torch.cat([h_t @ w, math.sqrt(ANCHOR) * h_t @ w])
    expected = torch.linalg.lstsq(stacked, target).solution
    assert spec["proj"] == ["down"] and spec["rank"] == min(intermediate, hidden)
    assert ((got - expected).norm() / expected.norm()) < 1e-3


def _stored(spec: dict, tensors: dict) -> int:
    """§1's count from the tensors: factors, plus kept values and the 16-bit-unit mask, or the core."""
    values = sum(t.numel() for name, t in tensors.items() if name not in ("core_values", "core_mask"))
    if "core_values" in tensors:
        values += tensors["core_values"].numel() + math.ceil(math.prod(spec["shape"]) / 16)
    return values


@pytest.mark.parametrize("ratio", [0.3, 0.6])
def test_the_joint_gate_up_tensor_fits_its_budget_and_is_what_is_written(tiny_folder, tmp_path, ratio):
    manifest = compress(CompressOptions(model=str(tiny_folder("gqa")), device="cpu", ratio=ratio, calib_samples=4,
                                        seq_len=32, dtype="float16", scope="model"), tmp_path / "a", progress=False)
    layout = layout_of(tiny_model("gqa").config)
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        for entry in manifest["layers"]:
            group = next(g for g in entry["groups"] if g["proj"] == ["gate", "up"])
            prefix = f"{layout.layers_path}.{entry['index']}.ftc.gateup."
            tensors = {name[len(prefix):]: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}
            assert group["kind"] == "tucker" and group["shape"][0] == 2
            assert _stored(group, tensors) == group["values"] <= int(ratio * layout.mlp_in_params)
            assert group["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    storage = manifest["storage"]
    assert storage["scope"] == "model"
    assert storage["parts"]["gateup"]["values_used"] <= storage["parts"]["gateup"]["budget_values"]
    assert 1 - ratio - 0.05 < storage["linear_reduction"] < 1 - ratio + 0.05


def test_budgets_that_hold_every_projection_reproduce_the_model(monkeypatch):
    """With budgets above each part's dense size the factorisations are exact (full ranks, dense
    cores, a `W_down` target equal to the original when gate and up are): the logits are the
    original's. The damping of the calibrated solves (§3, relative 1e-4 by default) is the one
    deliberate bias left; it is set negligible here, the Grams being well conditioned."""
    monkeypatch.setattr("ftc.numerics.metric.DEFAULT_EPS", 1e-12)
    model = tiny_model("gqa", layers=2)
    layout = layout_of(model.config)
    with torch.no_grad():
        reference = model(PROBE).logits
    ample = {part: 8 * size for part, size in layout.part_params("model").items()}
    method = make_method("ftc", 1.0, torch.float32, scope="model")
    method = type(method)(1.0, torch.float32, scope="model", budgets=(ample, ample))
    compress_model(model, layout, method, CALIB, device=torch.device("cpu"))
    with torch.no_grad():
        logits = model(PROBE).logits
    assert ((logits - reference).norm() / reference.norm()) < 1e-4


def test_scope_model_refuses_what_it_cannot_plan():
    with pytest.raises(InputError, match="plans the attention only"):
        CompressOptions(scope="model", allocation="global").validate()
    with pytest.raises(InputError, match="needs scope 'model'"):
        CompressOptions(ablate=("mlp_per_matrix",)).validate()


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_every_family_compresses_its_mlp_reloads_and_exports(layout_name, tiny_folder, tmp_path):
    """Every family with scope `model`: all seven projections (six for GPT-J) are factor groups, the
    reloaded artifact computes the compressing process's logits, and the dense export is a stock
    checkpoint computing the same."""
    from transformers import AutoModelForCausalLM

    from ftc.runtime.export import export_dense

    folder = tiny_folder(layout_name)
    options = CompressOptions(model=str(folder), device="cpu", ratio=0.5, calib_samples=4, seq_len=32,
                              dtype="float32", scope="model", allocation="uniform")  # no unit kept whole
    manifest = compress(options, tmp_path / "a", progress=False)
    layout = layout_of(AutoModelForCausalLM.from_pretrained(folder).config)
    covered = {p for entry in manifest["layers"] for g in entry["groups"] for p in g["proj"]}
    assert covered == set(layout.all_projections)
    reloaded, _, _ = load_artifact(tmp_path / "a")
    export_dense(tmp_path / "a", tmp_path / "d", "float32")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    for name, _ in dense.named_parameters():
        assert "ftc" not in name
    probe = PROBE % dense.config.vocab_size
    with torch.no_grad():
        a, b = reloaded(probe).logits, dense(probe).logits
    assert ((a - b).norm() / a.norm()) < 1e-4


def test_the_layer_stream_is_not_the_original_one_after_a_compressed_mlp(tmp_path):
    """The mutation this guards: propagation through the original MLP (the stream would then not be
    the compressed model's). Layer 1's attention Gram must come from layer 0 with its MLP compressed."""
    layers = 2
    model = tiny_model("gqa", layers=layers)
    layout = layout_of(model.config)
    grams = []
    method = make_method("ftc", 0.4, torch.float32, scope="model")

    class Watch(Recorder):
        def qkv(self, weights, x, layout):
            grams.append(x.gram.clone())
            return self.method.qkv(weights, x, layout)

    compress_model(model, layout, Watch(method), CALIB, device=torch.device("cpu"), batch_size=4)
    x = _inputs(_student(model, layout, layers, 1), layout, 1, layout.q)
    assert _close(grams[1], _gram(x, first_weight=SINK_WEIGHT))
    attention_only = _student(model, layout, layers, 0, attention_of=0)
    assert not _close(grams[1], _gram(_inputs(attention_only, layout, 1, layout.q), first_weight=SINK_WEIGHT))


def _whole_plan(layout, ratio: float = 0.5) -> list[dict]:
    """Three layers' budgets: layer 0's attention kept whole, layer 1's MLP, layer 2 compressed alike."""
    params = layout.part_params("model")
    cut = {part: int(ratio * size) for part, size in params.items()}
    return [{**cut, "qkv": params["qkv"], "o": params["o"], "whole": ["attention"]},
            {**cut, "gateup": params["gateup"], "down": params["down"], "whole": ["mlp"]}, cut]


def test_units_the_plan_keeps_whole_stay_original_and_feed_the_stream():
    """§15: a unit the plan keeps whole keeps its projections; layer 0's MLP is fitted on what the
    original attention hands it, and layer 2 on the stream of the model compressed so far (layer 1's
    attention compressed, its MLP whole)."""
    layers = 3
    model = tiny_model("gqa", layers=layers)
    layout = layout_of(model.config)
    original = tiny_model("gqa", layers=layers)
    planned = make_method("ftc", 0.5, torch.float32, scope="model")
    planned = type(planned)(0.5, torch.float32, scope="model", budgets=tuple(_whole_plan(layout)))

    class Planned(Recorder):
        def at_layer(self, index: int):
            self.method = planned.at_layer(index)
            return self

    method = Planned(planned)
    result = compress_model(model, layout, method, CALIB, device=torch.device("cpu"), batch_size=4)
    held = [{p for spec, _ in layer.groups for p in spec["proj"]} for layer in result.layers]
    assert held == [set(layout.mlp_projections), set(layout.projections), set(layout.all_projections)]
    assert [layer.report.get("whole") for layer in result.layers] == [["attention"], ["mlp"], None]
    for index, keys in ((0, layout.projections), (1, layout.mlp_projections)):
        for name in keys.values():
            kept, source = (get_module(decoder_layers(m, layout)[index], name) for m in (model, original))
            assert type(kept) is torch.nn.Linear and torch.equal(kept.weight, source.weight), (index, name)
    assert len(method.mlp_grams) == 2  # layers 0 and 2
    assert _close(method.mlp_grams[0], _gram(_inputs(original, layout, 0, layout.gate), first_weight=SINK_WEIGHT))
    x = _inputs(_student(model, layout, layers, 2, attention_of=2), layout, 2, layout.gate)
    assert _close(method.mlp_grams[1], _gram(x, first_weight=SINK_WEIGHT))


def test_an_artifact_with_whole_units_stores_them_dense_counts_them_and_reloads(tiny_folder, tmp_path):
    """The dense weights of whole units are the artifact's own (no groups), counted in the values each
    part keeps; the reload computes the logits of the pipeline's model and exports to stock weights."""
    from transformers import AutoModelForCausalLM

    from ftc.runtime.export import export_dense

    folder = tiny_folder("gqa", layers=3)
    layout = layout_of(tiny_model("gqa", layers=3).config)
    plan = _whole_plan(layout)
    options = CompressOptions(model=str(folder), device="cpu", ratio=0.5, calib_samples=4, seq_len=32,
                              dtype="float32", scope="model")
    manifest = compress(options, tmp_path / "a", progress=False, budgets=plan)
    assert [e.get("whole") for e in manifest["layers"]] == [["attention"], ["mlp"], None]
    parts = manifest["storage"]["parts"]
    params = layout.part_params("model")
    for part, size in params.items():  # one layer keeps each part whole
        groups = sum(g["values"] for e in manifest["layers"] for g in e["groups"] if part_of(g["proj"]) == part)
        assert parts[part]["values_used"] == groups + size <= parts[part]["budget_values"], part
    reloaded, _, _ = load_artifact(tmp_path / "a")
    assert type(get_module(decoder_layers(reloaded, layout)[0], layout.q)) is torch.nn.Linear
    source = AutoModelForCausalLM.from_pretrained(folder)
    for name in layout.mlp_projections.values():
        kept, original = (get_module(decoder_layers(m, layout)[1], name).weight for m in (reloaded, source))
        assert torch.equal(kept, original)
    export_dense(tmp_path / "a", tmp_path / "d", "float32")
    dense_model = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    probe = PROBE % dense_model.config.vocab_size
    with torch.no_grad():
        a, b = reloaded(probe).logits, dense_model(probe).logits
    assert ((a - b).norm() / a.norm()) < 1e-4


def test_a_per_matrix_mlp_spends_the_planned_gate_up_budget(tiny_folder, tmp_path):
    """`mlp_per_matrix` under a plan (§15 plans gate/up as one part): gate and up each get half of the
    layer's planned `gateup` values, not `keep_ratio`'s share, and the manifest's budget is that."""
    folder = tiny_folder("gqa", layers=3)
    layout = layout_of(tiny_model("gqa", layers=3).config)
    params = layout.part_params("model")
    plan = [{part: int(r * size) for part, size in params.items()} for r in (0.2, 0.5, 0.8)]
    options = CompressOptions(model=str(folder), device="cpu", ratio=0.5, calib_samples=4, seq_len=32,
                              dtype="float32", scope="model", ablate=("mlp_per_matrix",))
    manifest = compress(options, tmp_path / "a", progress=False, budgets=plan)
    for entry, budget in zip(manifest["layers"], plan, strict=True):
        gate_up = [g for g in entry["groups"] if part_of(g["proj"]) == "gateup"]
        assert len(gate_up) == 2 and all(g["values"] <= budget["gateup"] // 2 for g in gate_up)
        assert sum(g["values"] for g in gate_up) > 0.7 * budget["gateup"]
        assert entry["budget_values"]["gateup"] == budget["gateup"] // 2 * 2


def test_dense_cores_are_stored_whole_and_the_speed_runtime_holds_about_what_is_stored(tiny_folder, tmp_path):
    """`--ablate dense_core` (§9): every Tucker group is written with a dense `core` (no mask), within
    its budget, and the `speed` runtime's forms hold what is stored (a dense core's factored or
    merged form is its stored tensors, or within a few percent of them), where the default sparse
    cores are held scattered, at more than they store."""
    options = CompressOptions(model=str(tiny_folder("gqa")), device="cpu", ratio=0.5, calib_samples=4, seq_len=32,
                              dtype="float16", scope="model", allocation="uniform")
    held = {}
    for ablate in ((), ("dense_core",)):
        folder = tmp_path / ("dense" if ablate else "sparse")
        manifest = compress(dataclasses.replace(options, ablate=ablate), folder, progress=False)
        groups = [g for entry in manifest["layers"] for g in entry["groups"] if g["kind"] == "tucker"]
        assert groups and all(("kept" not in g) == bool(ablate) for g in groups)
        model, _, _ = load_artifact(folder)
        forms = runtime_forms(model)
        held[ablate] = sum(r["values"] for r in forms) / sum(r["stored_values"] for r in forms)
        if ablate:
            for r in forms:
                assert r["values"] <= 1.1 * r["stored_values"], r
    assert held[("dense_core",)] <= 1.1 < held[()]

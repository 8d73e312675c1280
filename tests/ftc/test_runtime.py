"""The runtime forms of stored groups (ftc-method.md §9): the rule that picks one from the shapes,
every form computing the group's slices, nothing converted or scattered per forward in the speed
forms, and one runtime in `load_artifact` and the transformers remote code for every family."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM

from ftc.compression.pipeline import layer_inputs
from ftc.models.arch import decoder_layers, layout_of
from ftc.numerics.cp import CPFactors
from ftc.numerics.tucker import TuckerFactors
from ftc.options import InputError
from ftc.runtime.artifact import load_artifact
from ftc.runtime.hf.modeling_ftc import (
    SPLIT_FORMS,
    SPLIT_ROWS,
    FactorGroup,
    FormCost,
    FusedProjection,
    choose_form,
    form_costs,
    held_values,
    modules_of,
    place,
    projections,
)
from ftc.runtime.stored import build_group, cp_tensors, lowrank_tensors, pack_mask, tucker_tensors
from tests.support.tiny import LAYOUTS, tiny_model

IDS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(3))
D = torch.float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _tucker_spec(d: int, r1: int, r2: int, width: int, heads: list[int], kept: int | None = None,
                 kv_repeat: int = 1) -> dict:
    slices = heads[0] + kv_repeat * sum(heads[1:])
    shapes = {"U1": [d, r1], "U2": [width, r2]}
    if kept is None:
        shapes["core"] = [slices, r1, r2]
    else:
        shapes.update(core_values=[kept], core_mask=[-(-slices * r1 * r2 // 8)])
    return {"kind": "tucker", "proj": ["q", "k", "v"][: len(heads)], "heads": heads, "shape": [slices, r1, r2],
            "kv_repeat": kv_repeat, "shapes": shapes}


# --- the rule: a function of the shapes -----------------------------------------------------------


def test_costs_are_counted_from_the_shapes():
    # SmolLM2's Q/K/V at rho 0.4: 9 query and 3 K/V heads of 64, r1 190, full r2, a sparse core
    spec = _tucker_spec(576, 190, 64, 64, [9, 3, 3], kept=95612)
    costs = form_costs(spec)
    assert costs["stored"] == FormCost(576 * 190 + 15 * 190 * 64 + 15 * 64 * 64, 576 * 190 + 64 * 64 + 95612 + 22800,
                                       3, rebuilt=15 * 190 * 64)
    assert costs["stored"].values == held_values(spec)
    assert costs["factored"] == FormCost(576 * 190 + 15 * 190 * 64 + 15 * 64 * 64, 576 * 190 + 15 * 190 * 64 + 64 * 64,
                                         3)
    # the split forms: the latent, then one product per member (q, k, v) over its own columns
    assert costs["merged"] == FormCost(576 * 190 + 190 * 15 * 64, 576 * 190 + 190 * 15 * 64, 1 + 3)
    assert costs["dense"] == FormCost(576 * 960, 576 * 960, 3)
    assert costs["merged"].per_token == 2 * (576 * 190 + 190 * 960)
    # kv_repeat: K/V stored twice each (S = 4 + 2 * 2 * 2), output slices averaged in the runtime forms
    repeated = form_costs(_tucker_spec(32, 6, 4, 8, [4, 2, 2], kv_repeat=2))
    assert repeated["stored"].macs == 32 * 6 + 12 * 6 * 4 + 12 * 4 * 8
    assert repeated["factored"].macs == 32 * 6 + 8 * 6 * 4 + 8 * 4 * 8 and repeated["dense"].values == 32 * 64
    # no U2 (the identity, w = r2): no U2 product, and no factored form (it would be the merged one)
    identity = {"kind": "tucker", "proj": ["gate", "up"], "heads": [1, 1], "shape": [2, 300, 1536],
                "shapes": {"U1": [576, 300], "core_values": [500000], "core_mask": [115200]}}
    costs = form_costs(identity)
    assert set(costs) == {"stored", "merged", "dense"}
    assert costs["stored"] == FormCost(576 * 300 + 2 * 300 * 1536, 576 * 300 + 500000 + 115200, 2, 2 * 300 * 1536)
    assert costs["merged"].values == 576 * 300 + 300 * 2 * 1536 and costs["dense"].macs == 576 * 2 * 1536


@pytest.mark.parametrize(("spec", "expected"), [
    (_tucker_spec(576, 190, 64, 64, [9, 3, 3], kept=95612), "merged"),  # full r2: G U2^T costs nothing more
    (_tucker_spec(576, 100, 8, 64, [9, 3, 3], kept=5000), "factored"),  # small r2: U2 applied per slice is cheaper
    (_tucker_spec(576, 560, 64, 64, [9, 3, 3], kept=200000), "dense"),  # r1 near d: the factors outgrow W
    # the MLP's gate/up: two slices as wide as the intermediate size
    ({**_tucker_spec(576, 300, 1200, 1536, [1, 1]), "proj": ["gate", "up"]}, "merged"),
    ({"kind": "lowrank", "proj": ["o"], "shapes": {"A": [576, 57], "B": [57, 576]}}, "factored"),
    ({"kind": "lowrank", "proj": ["o"], "shapes": {"A": [576, 400], "B": [400, 576]}}, "dense"),
    # CP: merging saves only the per-slice scaling (S R multiply-adds) and holds R S w values for R (S + w)
    ({"kind": "cp", "proj": ["q", "k", "v"], "heads": [9, 3, 3],
      "shapes": {"A": [576, 300], "B": [64, 300], "C": [15, 300]}}, "factored"),
])
def test_speed_takes_the_cheapest_form_per_token_and_memory_the_stored(spec, expected):
    costs = form_costs(spec)
    assert choose_form(spec, "speed") == expected
    assert costs[expected].per_token == min(c.per_token for f, c in costs.items() if f != "stored")
    assert choose_form(spec, "memory") == "stored"


def test_the_cp_choice_weighs_values_read_not_only_multiply_adds():
    spec = {"kind": "cp", "proj": ["q", "k", "v"], "heads": [9, 3, 3],
            "shapes": {"A": [576, 300], "B": [64, 300], "C": [15, 300]}}
    costs = form_costs(spec)
    assert costs["merged"].macs < costs["factored"].macs  # fewer multiply-adds, yet not chosen
    assert costs["merged"].values > 2 * costs["factored"].values


def test_an_unknown_runtime_names_the_choices():
    with pytest.raises(ValueError, match=r"ftc_runtime must be one of speed, memory; got 'fast'"):
        choose_form(_tucker_spec(8, 2, 2, 4, [1]), "fast")


# --- every form computes the group's slices --------------------------------------------------------


def _groups() -> dict[str, tuple[dict, dict[str, torch.Tensor], torch.Tensor]]:
    """Specs, stored tensors and the `(S', d, w)` slices they stand for, of every group shape."""
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=D)

    out = {}
    for name, heads, width, repeat, sparse in (("tucker_sparse", [4, 2, 2], 8, 1, True),
                                               ("tucker_dense", [4, 2, 2], 8, 1, False),
                                               ("tucker_kv_repeat", [2, 1, 1], 8, 2, True),
                                               ("tucker_gate_up", [1, 1], 24, 1, True)):
        spec = _tucker_spec(16, 6, 5, width, heads, kv_repeat=repeat)
        spec["proj"] = ["gate", "up"] if name == "tucker_gate_up" else spec["proj"]
        slices = spec["shape"][0]
        mask = rand(slices, 6, 5) > 0 if sparse else None
        core = rand(slices, 6, 5) * (1 if mask is None else mask)
        factors = TuckerFactors(rand(16, 6), rand(width, 5), core, mask)
        tensors = tucker_tensors(factors, D)
        spec["shapes"] = {k: list(t.shape) for k, t in tensors.items()}
        weights = factors.weights()  # (S, d, w)
        if repeat > 1:  # the copies of each K and V head averaged
            weights = torch.cat([weights[: heads[0]], weights[heads[0]:].unflatten(0, (-1, repeat)).mean(1)])
        out[name] = (spec, tensors, weights)
    # no stored U2 (the identity, §17): the MLP's gate/up, slices as wide as the core's r2
    mask = rand(2, 6, 24) > 0
    core, u1 = rand(2, 6, 24) * mask, rand(16, 6)
    tensors = {"U1": u1, "core_values": core[mask], "core_mask": pack_mask(mask)}
    out["tucker_no_u2"] = ({"kind": "tucker", "proj": ["gate", "up"], "heads": [1, 1], "shape": [2, 6, 24],
                            "shapes": {k: list(t.shape) for k, t in tensors.items()}}, tensors, u1 @ core)
    a, b, c = rand(16, 7), rand(8, 7), rand(8, 7)
    out["cp"] = ({"kind": "cp", "proj": ["q", "k", "v"], "heads": [4, 2, 2],
                  "shapes": {"A": [16, 7], "B": [8, 7], "C": [8, 7]}}, cp_tensors(CPFactors(a, b, c), D),
                 torch.einsum("dr,sr,wr->sdw", a, c, b))
    a, b = rand(16, 3), rand(3, 12)
    out["lowrank"] = ({"kind": "lowrank", "proj": ["o"], "shapes": {"A": [16, 3], "B": [3, 12]}},
                      lowrank_tensors(a, b, D), (a @ b).unsqueeze(0))
    return out


GROUPS = _groups()


def _held(group: FactorGroup) -> int:
    return sum(t.numel() for t in [*group.parameters(), *group.buffers()])


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_every_form_computes_the_groups_slices_and_holds_what_its_cost_counts(name):
    spec, tensors, weights = GROUPS[name]
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2), dtype=D)
    expected = torch.einsum("bnd,sdw->bnsw", x, weights).flatten(-2)
    costs = form_costs(spec)
    assert len(costs) >= 3
    for form in costs:
        group = build_group(spec, tensors, D)
        assert group.use_form(form) == group.form == form
        with torch.no_grad():
            torch.testing.assert_close(group(x), expected, rtol=1e-10, atol=1e-10)
        assert _held(group) == costs[form].values
        assert group.out_features == weights.shape[0] * weights.shape[2]


def test_a_group_holds_one_form_and_moves_off_the_stored_one_once():
    spec, tensors, _ = GROUPS["tucker_sparse"]
    group = build_group(spec, tensors, D, runtime="speed")
    assert group.form == "merged" and set(dict(group.named_parameters())) == {"U1", "M"}
    assert not list(group.buffers())
    assert group.prepare("speed") == "merged"  # idempotent
    with pytest.raises(RuntimeError, match="already runs in its 'merged' form"):
        group.use_form("dense")
    with pytest.raises(ValueError, match="no 'merged' form"):
        build_group(*GROUPS["lowrank"][:2], D).use_form("merged")


class _Calls(TorchFunctionMode):
    """Names of the torch functions and tensor methods called inside the block, and the ids of
    the positional arguments of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.args: list[set[int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        self.args.append({id(arg) for arg in args})
        return func(*args, **(kwargs or {}))

    def uses(self, tensor: torch.Tensor) -> int:
        """Calls `tensor` was a positional argument of."""
        return sum(id(tensor) in ids for ids in self.args)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_speed_forms_convert_and_scatter_nothing_per_forward(name):
    spec, tensors, _ = GROUPS[name]
    x = torch.randn(SPLIT_ROWS, 16, dtype=torch.float32)  # a prefill's rows: the split forms split
    stored = build_group(spec, tensors, torch.float32)
    with _Calls() as calls, torch.no_grad():
        stored(x)
    if "core_mask" in tensors:  # the stored form's scatter, seen by the same probe
        assert "masked_scatter_" in calls.names
    for form in form_costs(spec):
        if form == "stored":
            continue
        group = build_group(spec, tensors, torch.float32)
        group.use_form(form)
        modules = projections(group, {})
        with _Calls() as calls, torch.no_grad():
            for module in modules.values():
                module(x)
        assert not {"masked_scatter_", "to", "type", "contiguous", "clone", "permute", "zeros"} & set(calls.names), (
            form, calls.names)
        assert calls.names.count("matmul") == form_costs(spec)[form].gemms


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_sixteen_bit_forms_are_held_output_major(name):
    spec, tensors, weights = GROUPS[name]
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3), dtype=D)
    expected = torch.einsum("nd,sdw->nsw", x, weights).flatten(-2)
    for form in form_costs(spec):
        group = build_group(spec, tensors, torch.bfloat16)
        group.use_form(form)
        operands = [t for n, t in group.named_parameters() if n in group.operands]
        if form == "stored":  # kept as stored, so it saves back as it was read
            assert not group.one_row_ready
            continue
        assert operands and all(t.stride(0) == 1 for t in operands), form  # output-major: `nn.Linear`'s layout
        assert group.one_row_ready
        with torch.no_grad():
            assert _rel(group(x.to(torch.bfloat16)).double(), expected) < 3e-2, form  # bfloat16 rounding only
        assert not group.to(torch.float32).one_row_ready  # float32 runs MKL's GEMM either way
    fp32 = build_group(spec, tensors, torch.float32, runtime="speed")
    assert all(t.stride(-1) == 1 for t in fp32.parameters()) and not fp32.one_row_ready
    assert not fp32.to(torch.bfloat16).one_row_ready  # input-major: PyTorch's own kernel would be slower


# --- MLP groups: widths of their own, gate/up installed together -----------------------------------


MLP_NAMES = {
    "gqa": {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
    "phi3": {"gate": "mlp.gate_up_proj", "up": "mlp.gate_up_proj", "down": "mlp.down_proj"},
    "gptj": {"up": "mlp.fc_in", "down": "mlp.fc_out"},
}


def _exact_groups(layer: torch.nn.Module, names: dict[str, str]) -> list[tuple[dict, dict, dict]]:
    """The layer's MLP as groups that represent it exactly: gate/up (or GPT-J's up alone) a Tucker
    group with identity factors and the weights as core slices, down a low-rank group `W^T I`."""
    weights, biases = {}, {}
    for module, projs in modules_of(names, names).items():
        linear = layer.get_submodule(module)
        for proj, rows in zip(projs, linear.weight.detach().chunk(len(projs)), strict=True):
            weights[proj], biases[proj] = rows.T.double(), linear.bias
    up = [p for p in ("gate", "up") if p in names]
    d, width = weights["up"].shape
    core = torch.stack([weights[p] for p in up])  # (S, d, I): U1 = I_d, U2 = I_I
    factors = TuckerFactors(torch.eye(d, dtype=D), torch.eye(width, dtype=D), core, None)
    tucker = tucker_tensors(factors, torch.float32)
    down = lowrank_tensors(weights["down"], torch.eye(weights["down"].shape[1], dtype=D), torch.float32)
    return [({"kind": "tucker", "proj": up, "heads": [1] * len(up), "shape": list(core.shape),
              "shapes": {k: list(t.shape) for k, t in tucker.items()}}, tucker, biases),
            ({"kind": "lowrank", "proj": ["down"], "shapes": {k: list(t.shape) for k, t in down.items()}}, down,
             biases)]


@pytest.mark.parametrize("layout", sorted(MLP_NAMES))
@pytest.mark.parametrize("runtime", ["speed", "memory"])
def test_mlp_groups_installed_by_place_compute_the_layer(layout, runtime):
    """gate/up as one group (a fused `gate_up_proj` as one module, gate rows first), down a low-rank
    group, GPT-J's fc_in a one-slice group: the layer computes what it did."""
    model = tiny_model(layout)
    config = layout_of(model.config)
    layer = decoder_layers(model, config)[0]
    stream = layer_inputs(model, config, IDS, 2, torch.device("cpu"))
    (h,), (kw,) = stream.hidden, stream.kwargs
    names = MLP_NAMES[layout]
    with torch.no_grad():
        expected = layer(h, **kw)
        modules = {}
        for spec, tensors, biases in _exact_groups(layer, names):
            group = build_group(spec, tensors, torch.float32, runtime)
            modules.update(projections(group, biases))
        place(layer, names, modules)
        got = layer(h, **kw)
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    assert _rel(first(got), first(expected)) < 1e-5
    if layout == "phi3":
        fused = layer.get_submodule("mlp.gate_up_proj")
        assert isinstance(fused, FusedProjection) and fused.group is not None  # one call, no concatenation


def test_modules_of_orders_every_projection_by_projections():
    names = {"q": "a.qkv", "k": "a.qkv", "v": "a.qkv", "o": "a.o", "gate": "m.gu", "up": "m.gu", "down": "m.d"}
    assert modules_of(names, ["down", "up", "v", "gate", "o", "k", "q"]) == {
        "a.qkv": ["q", "k", "v"], "a.o": ["o"], "m.gu": ["gate", "up"], "m.d": ["down"]}


# --- one runtime in every loader, every family -----------------------------------------------------


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _generate(model, cache: bool = True) -> torch.Tensor:
    return model.generate(IDS[:1, :5], max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=cache,
                          pad_token_id=0)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_speed_and_memory_forms_give_the_same_logits_and_generation(layout, tiny_artifact):
    folder = tiny_artifact(layout)
    speed, _, _ = load_artifact(folder)
    memory, _, _ = load_artifact(folder, runtime="memory")
    forms = {r["form"] for r in speed.ftc_forms()}
    assert forms and "stored" not in forms and {r["form"] for r in memory.ftc_forms()} == {"stored"}
    assert _rel(_logits(speed), _logits(memory)) < 1e-5
    cached = _generate(speed)
    assert cached.shape[1] == 13
    assert torch.equal(cached, _generate(speed, cache=False)) and torch.equal(cached, _generate(memory))
    for form in ("factored", "merged", "dense"):  # every form in this family's modules, whatever the rule picks
        forced, _, _ = load_artifact(folder, runtime="memory")
        for group in (m for m in forced.modules() if isinstance(m, FactorGroup)):
            group.use_form(form if form in form_costs(group.spec) else "factored")
        assert _rel(_logits(forced), _logits(memory)) < 1e-5, form


class _Kernels(TorchFunctionMode):
    """Whether oneDNN was switched on at each matrix product inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.onednn: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("matmul", "linear"):
            self.onednn.append(torch.backends.mkldnn.enabled)
        return func(*args, **(kwargs or {}))


def test_bfloat16_loads_and_to_convert_the_prepared_tensors(tiny_artifact):
    folder = tiny_artifact("qwen2_bias")
    memory, _, _ = load_artifact(folder, torch.bfloat16, runtime="memory")
    speed, _, _ = load_artifact(folder, torch.bfloat16)
    moved = load_artifact(folder)[0].to(torch.bfloat16)
    for model in (speed, moved):
        groups = [m for m in model.modules() if isinstance(m, FactorGroup)]
        assert {p.dtype for g in groups for p in g.parameters()} == {torch.bfloat16}
        assert _rel(_logits(model), _logits(memory)) < 3e-2  # bfloat16 rounding only
    assert _rel(_logits(speed), _logits(load_artifact(folder)[0])) < 3e-2
    # loaded in bfloat16, the forms are held output-major and a one-token step runs off oneDNN;
    # converted after loading, they stay input-major and every step on it
    assert speed.ftc_one_row and not moved.ftc_one_row and not memory.ftc_one_row
    assert not speed.to(torch.float32).ftc_one_row and speed.to(torch.bfloat16).ftc_one_row
    for model, ids, onednn in ((speed, IDS[:1, :1], {False}), (speed, IDS[:1, :2], {True}),
                               (speed, IDS[:, :1], {True}), (moved, IDS[:1, :1], {True})):
        with _Kernels() as kernels:
            _logits(model, ids)
        assert set(kernels.onednn) == onednn, (ids.shape, onednn)
    assert torch.backends.mkldnn.enabled  # switched back on
    assert torch.equal(_generate(speed), _generate(speed, cache=False))


def test_a_speed_form_model_refuses_to_save_and_says_how(tiny_artifact, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_artifact("gqa"), trust_remote_code=True)
    with pytest.raises(RuntimeError, match=r"runs in its '\w+' form .* ftc_runtime='memory'"):
        model.save_pretrained(tmp_path / "saved")


def test_remote_code_takes_the_runtime_from_a_keyword_or_the_config(tiny_artifact):
    folder = tiny_artifact("gqa")
    default = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert {r["form"] for r in default.ftc_forms()} == {choose_form(r, "speed") for r in _specs(default)}
    keyword = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, ftc_runtime="memory")
    assert {r["form"] for r in keyword.ftc_forms()} == {"stored"}
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    config.ftc_runtime = "memory"
    configured = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, config=config)
    assert {r["form"] for r in configured.ftc_forms()} == {"stored"}
    with pytest.raises(ValueError, match="ftc_runtime must be one of speed, memory"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, ftc_runtime="fast")
    with pytest.raises(InputError, match="runtime must be one of speed, memory; got 'fast'"):
        load_artifact(folder, runtime="fast")


def _specs(model) -> list[dict]:
    return [model.get_submodule(r["group"]).spec for r in model.ftc_forms()]


def test_the_lm_eval_backend_runs_the_same_runtime(tiny_artifact):
    from ftc.evaluation.harness import FTCLM
    from ftc.models.registry import ModelError

    folder = str(tiny_artifact("gqa"))
    speed = FTCLM(pretrained=folder, device="cpu")
    memory = FTCLM(pretrained=folder, device="cpu", runtime="memory")
    assert {r["form"] for r in speed.model.ftc_forms()} == {r["form"] for r in load_artifact(folder)[0].ftc_forms()}
    assert {r["form"] for r in memory.model.ftc_forms()} == {"stored"}
    with pytest.raises(ModelError, match="runtime must be one of speed, memory; got 'fast'"):
        FTCLM(pretrained=folder, device="cpu", runtime="fast")


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("layout", ["gqa", "phi3"])
def test_a_groups_members_share_one_forward_in_inference_mode_too(layout, inference, tiny_artifact):
    """The members take the work they share (the latent `x @ U1`, or the whole output) from the
    first member's call: the first factor is applied once per group and forward, not once per
    member; also in inference mode, whose tensors keep no version counter."""
    model, _, _ = load_artifact(tiny_artifact(layout))
    groups = {f"{name}.{group.first}": group for name, group in model.named_modules()
              if isinstance(group, FactorGroup) and group.form != "dense" and not group.single}
    assert {g.form for g in groups.values()} == {"merged"}  # the split form's own sharing is what runs
    mode = torch.inference_mode() if inference else torch.no_grad()
    with _Calls() as calls, mode:
        model(IDS)
    assert {name: calls.uses(getattr(g, g.first)) for name, g in groups.items()} == dict.fromkeys(groups, 1)


@pytest.mark.parametrize("rows", [1, SPLIT_ROWS - 1, SPLIT_ROWS])
@pytest.mark.parametrize("name", [n for n in sorted(GROUPS) if len(GROUPS[n][0]["proj"]) > 1])
def test_split_forms_give_each_member_its_own_contiguous_columns(name, rows):
    """From `SPLIT_ROWS` rows on, `merged` and `dense` multiply each member's own columns: contiguous
    outputs equal to the columns of the group's whole output; the other forms, and every form at
    fewer rows (a decoding step), hand out views of that output."""
    spec, tensors, _ = GROUPS[name]
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(4), dtype=D)
    for form in form_costs(spec):
        group = build_group(spec, tensors, D)
        group.use_form(form)
        with torch.no_grad():
            whole = group(x)
            outputs = {proj: module(x) for proj, module in projections(group, {}).items()}
        for (proj, y), (start, stop) in zip(outputs.items(), group.column_ranges().values(), strict=True):
            torch.testing.assert_close(y, whole[..., start:stop], rtol=1e-12, atol=1e-12)
            own_rows = y.stride(-2) == y.shape[-1]  # a view of the whole output strides over all its columns
            assert own_rows == (form in SPLIT_FORMS and rows >= SPLIT_ROWS), (form, proj)

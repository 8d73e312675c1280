"""The method optimises and measures what ftc-method.md says, checked from the stored tensors.

Each test recomputes a quantity from its definition (the §1 storage formula, the §3-§4 objective,
the §7 one-shot bound) instead of asking the code that produced it, so a line that quietly stops
applying a weight, a bound or a budget fails here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from ftc.compression.methods import HEAD_EPS, make_method
from ftc.models.arch import layout_of
from ftc.numerics.lowrank import weighted_error
from ftc.numerics.metric import Moments, damp
from ftc.numerics.tucker import head_concat, hosvd, project_core, prune_refit, refit, top_k_mask, tucker_error
from tests.support.pipeline import compress_model
from tests.support.tiny import tiny_config, tiny_model

D = torch.float64


def _layer(seed: int = 0):
    """One GQA layer's Q/K/V weights (`(in, out)`) whose key heads are the hard part, and the Moments
    of strongly anisotropic inputs."""
    layout = layout_of(tiny_config("gqa"))
    g = torch.Generator().manual_seed(seed)
    d, dh = layout.hidden, layout.head_dim
    q = torch.randn(d, layout.heads * dh, generator=g, dtype=D)
    k = torch.randn(d, layout.kv_heads * dh, generator=g, dtype=D) * 2.0
    v = torch.randn(d, layout.kv_heads * dh, generator=g, dtype=D) * torch.logspace(0, -1, d, dtype=D)[:, None]
    x = Moments(d, "cpu")
    x.update(torch.randn(2, 256, d, generator=g) * torch.logspace(0, -1.5, d))
    return {"q": q, "k": k, "v": v}, x, layout


def _slices(groups: list, layout) -> torch.Tensor:
    """The `(S, d, dh)` head-concat tensor a stored Tucker group represents, per §9: `U1 G_s U2^T`,
    the core scattered from its values and bit-packed mask when sparse."""
    (spec, tensors), = groups
    u1, u2 = tensors["U1"].to(D), tensors["U2"].to(D)
    if "core" in tensors:
        core = tensors["core"].to(D)
    else:
        count = math.prod(spec["shape"])
        bits = np.unpackbits(tensors["core_mask"].numpy())[:count].astype(bool)
        core = torch.zeros(count, dtype=D)
        core[torch.from_numpy(bits)] = tensors["core_values"].to(D)
        core = core.view(spec["shape"])
    return u1 @ core @ u2.T


def _errors(method, weights, x, layout) -> tuple[float, float, dict]:
    """(key-weighted, unweighted) balanced activation errors of `method`'s stored Q/K/V, and its report."""
    groups, report = method.qkv(weights, x, layout)
    tensor = head_concat(weights["q"], weights["k"], weights["v"], layout.head_dim)
    approx = _slices(groups, layout)
    return (weighted_error(tensor, approx, x.gram, True, _key_weights(layout)),
            weighted_error(tensor, approx, x.gram, True), report)


def _key_weights(layout) -> torch.Tensor:
    """§4's slice weights from their definition: `Hq / Hkv` for a key slice, 1 for the others."""
    weights = torch.ones(layout.slices, dtype=D)
    weights[layout.heads : layout.heads + layout.kv_heads] = layout.heads // layout.kv_heads
    return weights


def test_the_guard_measures_the_key_weighted_balanced_objective():
    """§3's guard compares fits by the objective of §4 (slice balancing and key weights) in the
    undamped activation metric; the report carries the value it compared."""
    weights, x, layout = _layer()
    ftc = make_method("ftc", 0.4, torch.float32)
    weighted, unweighted, report = _errors(ftc, weights, x, layout)
    assert abs(unweighted - weighted) > 0.02 * weighted  # the two objectives are told apart here
    assert report["error_activation"] == pytest.approx(weighted, rel=1e-4)


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_the_fit_minimises_the_key_weighted_objective(ratio):
    """With the key weight (§4) FTC's stored Q/K/V has the lower key-weighted error, and without it
    (`no_key_weight`) the lower unweighted one: each fit optimises the objective it is given."""
    weights, x, layout = _layer(1)
    with_keys = _errors(make_method("ftc", ratio, torch.float32), weights, x, layout)
    without = _errors(make_method("ftc", ratio, torch.float32, ("no_key_weight",)), weights, x, layout)
    assert with_keys[0] < without[0]
    assert without[1] < with_keys[1]


def test_the_one_shot_support_bounds_the_gradual_path():
    """§7: the gradual prune is kept only if it ends no worse than the one-shot top-K core refitted on
    its own support. On this tensor (heavy-tailed entries, 4 of 150 core values kept) the gradual
    path ends 15% worse, so the bound decides the result."""
    g = torch.Generator().manual_seed(344)
    t = torch.randn(4, 10, 5, dtype=D, generator=g) ** 3
    u1, u2, _ = hosvd(t)
    u1, u2 = u1[:, :6].clone(), u2[:, :5].clone()
    one = refit(t, u1, u2, top_k_mask(project_core(t, u1, u2), 4), 1)
    bound = tucker_error(t, one[0], one[2], one[1])
    f1, f2, core, mask = prune_refit(t, u1, u2, 4)
    assert int(mask.sum()) == 4
    assert tucker_error(t, f1, core, f2) <= bound * (1 + 1e-12)


def _stored(spec: dict, tensors: dict) -> int:
    """Stored values of a group by §1, from its tensors' shapes: factors, plus the kept core values
    and the bit-packed mask in 16-bit units, or the dense core."""
    values = sum(t.numel() for name, t in tensors.items() if name not in ("core_values", "core_mask"))
    if "core_values" in tensors:
        values += tensors["core_values"].numel() + math.ceil(math.prod(spec["shape"]) / 16)
    return values


@pytest.mark.parametrize("method", ["ftc", "cp", "per_matrix", "svd", "svd_llm"])
@pytest.mark.parametrize("ratio", [0.3])
def test_every_layer_stays_within_its_uniform_budget_counted_from_the_tensors(method, ratio):
    """§1: Q/K/V within `rho d dh S` values (per matrix: `rho` of each), `W_O` within `rho Hq dh d`.
    (`asvd` and `svd_llm_v2` spread the ratio over layers by their own plans; their budgets are
    checked against their plans in test_asvd_search and test_allocation.)"""
    model = tiny_model("gqa", layers=1)
    layout = layout_of(model.config)
    calib = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0))
    result = compress_model(model, layout, make_method(method, ratio, torch.float16), calib, device=torch.device("cpu"))
    d, dh = layout.hidden, layout.head_dim
    sizes = {"q": d * dh * layout.heads, "k": d * dh * layout.kv_heads, "v": d * dh * layout.kv_heads,
             "o": layout.o_params}
    for layer in result.layers:
        for spec, tensors in layer.groups:
            budget = int(ratio * layout.qkv_params) if len(spec["proj"]) == 3 else int(ratio * sizes[spec["proj"][0]])
            assert _stored(spec, tensors) <= budget, (layer.index, spec["proj"])


def test_a_head_metric_weighs_the_fit_by_it():
    """`loss_metric` (§5): with one metric `H = L L^T` on the head dimension, FTC fits `W_s L` as it fits
    `W_s` and maps `U2` back, so its stored Q/K/V has the lower error in K-FAC's metric
    `tr(C dW H dW^T)` (weighted and balanced as §4), the plain fit the lower error in the plain one, the
    report carries the former, and an isotropic `H` is the plain fit."""
    weights, x, layout = _layer()
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(200, layout.head_dim, generator=g, dtype=D) * torch.logspace(1, -1, layout.head_dim, dtype=D)
    head = rows.T @ rows
    plain = make_method("ftc", 0.4, torch.float32)
    loss = dataclasses.replace(make_method("ftc", 0.4, torch.float32, ("loss_metric",)), output_metric={"qkv": head})
    tensor = head_concat(weights["q"], weights["k"], weights["v"], layout.head_dim)
    right = torch.linalg.cholesky(damp(head, HEAD_EPS))
    key_weights = _key_weights(layout)

    def errors(method) -> tuple[float, float, dict]:
        groups, report = method.qkv(weights, x, layout)
        approx = _slices(groups, layout)
        return (weighted_error(tensor @ right, approx @ right, x.gram, True, key_weights),
                weighted_error(tensor, approx, x.gram, True, key_weights), report)

    loss_kfac, loss_plain, report = errors(loss)
    plain_kfac, plain_plain, _ = errors(plain)
    assert loss_kfac < plain_kfac * 0.95 and plain_plain < loss_plain * 0.95
    assert report["error_activation"] == pytest.approx(loss_kfac, rel=1e-4)
    isotropic = dataclasses.replace(loss, output_metric={"qkv": 3.0 * torch.eye(layout.head_dim, dtype=D)})
    torch.testing.assert_close(_slices(isotropic.qkv(weights, x, layout)[0], layout),
                               _slices(plain.qkv(weights, x, layout)[0], layout), rtol=1e-4, atol=1e-5)

"""One registry per concept: method names, method classes, storage dtypes and manifest choices."""

from __future__ import annotations

import inspect

import pytest
import torch

from ftc.compression import sensitivity
from ftc.compression.compress import storage_dtype
from ftc.compression.methods import ANCHOR, METHOD_CLASSES, SINK_WEIGHT, Method, make_method, register
from ftc.numerics import lowrank, metric, tucker
from ftc.options import DTYPES, METHOD_DESCRIPTIONS, METHODS, InputError


def default(function, parameter: str):
    return inspect.signature(function).parameters[parameter].default


def test_every_listed_method_has_exactly_its_class():
    assert set(METHOD_CLASSES) == set(METHODS)
    for name, cls in METHOD_CLASSES.items():
        assert cls.name == name
        assert make_method(name, 0.5, torch.float32).name == name
    assert all(METHOD_DESCRIPTIONS[name] for name in METHODS)


def test_register_refuses_a_name_missing_from_options():
    with pytest.raises(ValueError, match="METHOD_DESCRIPTIONS"):
        register("not_a_method")(type("Stray", (Method,), {}))
    assert "not_a_method" not in METHOD_CLASSES


def test_register_refuses_a_second_class_for_a_name():
    with pytest.raises(ValueError, match="already bound"):
        register("svd")(type("Again", (Method,), {}))
    assert METHOD_CLASSES["svd"].__name__ == "SVD"


def test_storage_dtypes_map_by_name_and_reject_unknown():
    for name in DTYPES:
        assert storage_dtype(name) is getattr(torch, name)
        assert storage_dtype(name).is_floating_point
    with pytest.raises(InputError, match="float16"):
        storage_dtype("int8")


def test_choices_are_the_defaults_the_code_runs_with():
    """The manifest's `choices` must equal the defaults of the functions that use them."""
    ftc = make_method("ftc", 0.5, torch.float16).choices()
    # eps and max_eps are read from the module when called (None defaults), so a tuning run that sets them is seen
    assert default(metric.damped_whitenings, "eps") is default(metric.Whitening.from_gram, "eps") is None
    assert default(metric.damped_whitenings, "max_eps") is None
    assert (ftc["eps"], ftc["max_eps"]) == (metric.DEFAULT_EPS, metric.MAX_EPS)
    assert ftc["guard_tolerance"] == metric.GUARD_TOLERANCE
    assert ftc["prune_steps"] == default(tucker.compress_tensor, "steps") == default(tucker.prune_refit, "steps")
    assert ftc["refits"] == default(tucker.compress_tensor, "refits") == default(tucker.prune_refit, "refits")
    points = default(tucker.allocate, "grid_points")
    assert ftc["allocation_grid"].startswith(f"{points} x {points // 2} ")
    assert ftc["anchor"] == ANCHOR
    assert ftc["sink_weight"] == SINK_WEIGHT == make_method("ftc", 0.5, torch.float16).first_weight
    assert make_method("cp", 0.5, torch.float16).choices()["sink_weight"] == SINK_WEIGHT
    assert make_method("svd_llm", 0.5, torch.float16).first_weight == 1  # the baselines as published
    assert make_method("svd_llm", 0.5, torch.float16).choices() == {
        k: ftc[k] for k in ("eps", "max_eps", "guard", "guard_tolerance")}
    asvd = make_method("asvd", 0.5, torch.float16).choices()
    assert asvd["alpha"] == default(lowrank.scaled_svd, "alpha")
    assert asvd["rank_search"]["ratio_candidates"] == list(default(sensitivity.sensitivities, "ratios"))
    assert make_method("svd", 0.5, torch.float16).choices() == {}


def test_choices_follow_the_ablations():
    ablated = make_method("ftc", 0.5, torch.float16, ("no_anchor", "fixed_ranks", "no_sink")).choices()
    assert ablated["anchor"] == 0.0
    assert ablated["sink_weight"] == 1
    assert "fixed ranks" in ablated["allocation_grid"]

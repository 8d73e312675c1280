"""ASVD's sensitivity-based rank search (ftc-method.md §11 `asvd`) against its definitions."""

from __future__ import annotations

import copy
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

from ftc.compression import sensitivity
from ftc.compression.compress import CompressOptions, compress
from ftc.compression.methods import make_method
from ftc.compression.pipeline import capture_input, context_stats, layer_inputs, propagate
from ftc.compression.sensitivity import (
    CACHE_ENV,
    Sensitivity,
    cache_folder,
    search_budgets,
    sensitivities,
    sensitivity_file,
    threshold_ratios,
    whole_model,
)
from ftc.models.arch import decoder_layers, get_module, layout_of
from ftc.models.weights import ModuleSource
from ftc.numerics.lowrank import scaled_svd
from ftc.numerics.metric import Moments
from ftc.options import ASVD_SENSITIVITY_SEQUENCES, ASVD_UNLISTED_RATIO, InputError
from ftc.runtime.artifact import load_artifact
from tests.support.pipeline import compress_loaded, compress_model
from tests.support.tiny import tiny_model

CPU = torch.device("cpu")
BATCH = 4


def _calibration(model, samples: int = 8, length: int = 32) -> torch.Tensor:
    """Greedy continuations of random first tokens: text the model predicts well, so every
    truncation costs loss (on random tokens a random model's loss moves either way)."""
    ids = torch.randint(0, model.config.vocab_size, (samples, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(length - 1):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    return ids


def _confident(layout_name: str, layers: int = 3, seed: int = 0):
    model = tiny_model(layout_name, layers=layers, seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    return model


def test_threshold_ratios_on_a_worked_example():
    # two matrices of 100 values; ppl falls with the ratio, "b" is the sensitive one
    entries = [Sensitivity(0, "a", 0.1, 11.0), Sensitivity(0, "a", 0.5, 10.2),
               Sensitivity(0, "b", 0.1, 30.0), Sensitivity(0, "b", 0.5, 12.0)]
    sizes = {(0, "a"): 100, (0, "b"): 100}
    # sorted: b0.1 (30), b0.5 (12), a0.1 (11), a0.5 (10.2); thresholds from high to low
    assert threshold_ratios(entries, sizes, 20) == {(0, "a"): 0.1, (0, "b"): 0.1}
    assert threshold_ratios(entries, sizes, 60) == {(0, "a"): 0.1, (0, "b"): 0.5}
    assert threshold_ratios(entries, sizes, 110) == {(0, "a"): 0.1, (0, "b"): ASVD_UNLISTED_RATIO}
    assert threshold_ratios(entries, sizes, 149) == {(0, "a"): 0.1, (0, "b"): ASVD_UNLISTED_RATIO}
    assert threshold_ratios(entries, sizes, 150) == {(0, "a"): 0.5, (0, "b"): ASVD_UNLISTED_RATIO}
    assert threshold_ratios(entries, sizes, 200) == {(0, "a"): ASVD_UNLISTED_RATIO, (0, "b"): ASVD_UNLISTED_RATIO}
    with pytest.raises(InputError, match="--ratio"):
        threshold_ratios(entries, sizes, 19)


@pytest.mark.parametrize("seed", range(4))
def test_threshold_ratios_is_the_lowest_threshold_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    units = [(i, p) for i in range(3) for p in "qkvo"]
    sizes = {u: int(torch.randint(50, 500, (1,), generator=g)) for u in units}
    ratios = (0.1, 0.3, 0.5, 0.7, 0.9)
    entries = [Sensitivity(i, p, r, float(torch.rand(1, generator=g)))
               for (i, p), r in itertools.product(units, ratios)]

    def by_threshold(threshold: float) -> dict:  # the definition: smallest ratio whose ppl <= threshold
        under = [e for e in entries if e.loss <= threshold]
        return {u: min([e.ratio for e in under if (e.layer, e.proj) == u], default=ASVD_UNLISTED_RATIO) for u in units}

    def cost(plan: dict) -> int:
        return sum(int(plan[u] * sizes[u]) for u in units)

    thresholds = sorted({e.loss for e in entries} | {-1.0})
    for budget in (int(0.1 * sum(sizes.values())), int(0.4 * sum(sizes.values())), int(0.8 * sum(sizes.values()))):
        plan = threshold_ratios(entries, sizes, budget)
        assert cost(plan) <= budget
        lowest = min(t for t in thresholds if cost(by_threshold(t)) <= budget)  # the best plan that fits
        assert plan == by_threshold(lowest)


def _abs_means(model, layout, calib):
    """Per layer, mean |x| at the Q/K/V and `W_O` inputs, through the layer pipeline's own statistics."""
    stream = layer_inputs(model, layout, calib, BATCH, CPU)
    means = []
    for index, layer in enumerate(decoder_layers(model, layout)):
        at = stream.at(index)
        x = Moments(layout.hidden, CPU, absolute=True)
        for h, kw in at.batches():
            x.update(capture_input(layer, layout.q, h, kw))
        ctx, _ = context_stats(layer, layout, at, None, absolute=True)
        means.append({"qkv": x.abs_mean, "o": ctx.teacher.abs_mean})
        propagate(layer, at)
    return means


def _perplexity_with(model, layout, index: int, proj: str, weight: torch.Tensor, ids: torch.Tensor) -> float:
    """The definition: a copy of the model with one matrix (`(in, out)` layout) replaced, run whole."""
    changed = copy.deepcopy(model)
    module = get_module(decoder_layers(changed, layout)[index], layout.projections[proj])
    start, stop = layout.qkv_rows[proj] if proj != "o" and layout.fused_qkv else (0, module.weight.shape[0])
    with torch.no_grad():
        module.weight[start:stop] = weight.T.to(torch.float32)
        logits = changed(ids).logits
    return math.exp(float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())))


@pytest.mark.parametrize("layout_name", ["gqa", "phi3", "gemma3"])
def test_each_sensitivity_is_the_perplexity_with_that_matrix_truncated(layout_name):
    model = _confident(layout_name)
    layout = layout_of(model.config)
    calib = _calibration(model)
    method = make_method("asvd", 0.4, torch.float16)
    ratios = (0.2, 0.7)
    entries = sensitivities(method, model, layout, calib, batch_size=BATCH, progress=False, ratios=ratios)
    assert [(e.layer, e.proj, e.ratio) for e in entries] == list(itertools.product(range(3), "qkvo", ratios))
    means = _abs_means(model, layout, calib)
    ids = calib[:ASVD_SENSITIVITY_SEQUENCES]
    for e in entries:
        w = dict(zip("qkvo", (get_module(decoder_layers(model, layout)[e.layer], n).weight
                              for n in layout.projections.values()), strict=True))[e.proj]
        if e.proj != "o" and layout.fused_qkv:
            w = w[slice(*layout.qkv_rows[e.proj])]
        w = w.detach().T
        rows, cols = w.shape
        rank = max(1, int(e.ratio * rows * cols) // (rows + cols))
        a, b = scaled_svd(w, means[e.layer]["o" if e.proj == "o" else "qkv"], rank)
        truncated = a.to(torch.float16).double() @ b.to(torch.float16).double()  # as stored
        expected = _perplexity_with(model, layout, e.layer, e.proj, truncated, ids)
        assert e.loss == pytest.approx(expected, rel=1e-5), e


def _low_rank(w: torch.Tensor, rank: int = 2) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def test_a_planted_sensitive_matrix_gets_the_budget():
    """Every matrix but layer 1's W_V is exactly rank 2, so its truncations (at rank >= 2, stored in
    float32) lose nothing; a budget that fits W_V whole and the rest at the smallest ratio must go there."""
    model = _confident("gqa")
    layout = layout_of(model.config)
    planted = (1, "v")
    with torch.no_grad():
        for index, layer in enumerate(decoder_layers(model, layout)):
            for proj, name in layout.projections.items():
                if (index, proj) != planted:
                    module = get_module(layer, name)
                    module.weight.copy_(_low_rank(module.weight))
    calib = _calibration(model)
    sizes = {"q": 64 * 64, "k": 64 * 32, "v": 64 * 32, "o": 64 * 64}
    total = 3 * sum(sizes.values())
    rho = (0.1 * (total - sizes["v"]) + sizes["v"]) / total
    method = search_budgets(make_method("asvd", rho, torch.float32), model, layout, calib, batch_size=BATCH,
                            progress=False)
    ratios = {(i, p): budget[p] / sizes[p] for i, budget in enumerate(method.budgets) for p in "qkvo"}
    assert ratios.pop(planted) == pytest.approx(ASVD_UNLISTED_RATIO)
    assert max(ratios.values()) == pytest.approx(0.1, abs=1e-3)


def test_the_search_stays_within_rho_of_the_attention_parameters():
    model = _confident("gqa")
    layout = layout_of(model.config)
    calib = _calibration(model)
    rho = 0.3
    result = compress_model(model, layout, make_method("asvd", rho, torch.float16), calib, device=CPU,
                            batch_size=BATCH)
    spent = sum(t.numel() for layer in result.layers for _, tensors in layer.groups for t in tensors.values())
    assert spent <= rho * 3 * (layout.qkv_params + layout.o_params)
    ranks = [spec["rank"] for layer in result.layers for spec, _ in layer.groups]
    assert len(set(ranks)) > 2, "the search should not give every matrix of a shape the same rank"


@pytest.mark.parametrize(("method", "allocation", "search", "user"), [
    ("asvd", "uniform", "sensitivities", "asvd"),  # ASVD's per-matrix list
    ("ftc", "sensitivity", "layer_sensitivities", "allocation 'sensitivity'"),  # the layer list (§15)
])
def test_a_ratio_below_the_smallest_candidate_is_refused_before_any_work(method, allocation, search, user,
                                                                         monkeypatch):
    model = tiny_model("gqa")

    def measure(*args, **kwargs):
        raise AssertionError("the sensitivity pass ran")

    monkeypatch.setattr(sensitivity, search, measure)
    with pytest.raises(InputError, match=rf"ratio 0\.05 is below .* at least 0\.1 with {user}"):
        search_budgets(make_method(method, 0.05, torch.float16, allocation=allocation), model,
                       layout_of(model.config), torch.zeros(2, 8, dtype=torch.long), batch_size=BATCH,
                       progress=False)
    with pytest.raises(InputError, match=r"^--ratio 0\.05 is below"):  # the CLI's options, before loading
        CompressOptions(model="smollm2-135m", method="asvd", ratio=0.05).validate()
    with pytest.raises(InputError, match=r"^--ratio 0\.05 is below .* with --allocation 'sensitivity'"):
        CompressOptions(model="smollm2-135m", method="cp", ratio=0.05, allocation="sensitivity").validate()
    with pytest.raises(InputError, match=r"^--allocation 'global' applies to method 'ftc' only, not 'cp'"):
        CompressOptions(model="smollm2-135m", method="cp", allocation="global").validate()


def test_the_search_uses_a_resident_float32_model_itself():
    """No second copy of a model already in memory; a 16-bit one is materialised in float32 compute."""
    model = tiny_model("gqa")
    assert whole_model(ModuleSource(model), CPU, model) is model
    half = copy.deepcopy(model).to(torch.bfloat16)
    rebuilt = whole_model(ModuleSource(half), CPU, half)
    assert rebuilt is not half and rebuilt.get_input_embeddings().weight.dtype == torch.float32


def test_a_streamed_asvd_run_equals_the_in_memory_run_and_resumes(tiny_folder, smollm2_tokenizer, tmp_path):
    """From a saved folder (the whole model materialised for the search, tied head included) and
    from the model in memory, the same plan and the same artifact; the work dir resumes that plan."""
    folder = tiny_folder("gemma_mqa", layers=2)
    fields = dict(method="asvd", ratio=0.4, calib_samples=6, seq_len=32, dtype="float32", batch_size=4)
    work = tmp_path / "work"
    manifest = compress(CompressOptions(model=str(folder), device="cpu", **fields), tmp_path / "streamed",
                        work_dir=work, progress=False)
    streamed, _, _ = load_artifact(tmp_path / "streamed")
    model = tiny_model("gemma_mqa", vocab_size=len(smollm2_tokenizer), layers=2)
    in_memory, memory_manifest, _ = compress_loaded(model, smollm2_tokenizer, tmp_path / "in-memory", **fields)
    budgets = manifest["allocation"]["layer_budgets"]
    assert budgets == memory_manifest["allocation"]["layer_budgets"] and len({str(b) for b in budgets}) > 1
    assert manifest["choices"]["rank_search"]["sensitivity_sequences"] == ASVD_SENSITIVITY_SEQUENCES
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, in_memory(ids).logits, rtol=1e-5, atol=1e-5)
    again = compress(CompressOptions(model=str(folder), device="cpu", **fields), tmp_path / "again", work_dir=work,
                     progress=False)
    assert again["resumed_from_layer"] == 2 and again["allocation"]["layer_budgets"] == budgets


def test_a_second_ratio_plans_from_the_kept_sensitivity_list(tiny_folder, tmp_path, monkeypatch):
    """The list does not depend on rho: measured once, a run at another ratio plans from it exactly
    what a fresh search plans. A changed list changes the plan (so the file is what is read), and a
    damaged file is measured again and replaced."""
    folder = tiny_folder("gqa", layers=2)
    fields = dict(model=str(folder), device="cpu", method="asvd", calib_samples=6, seq_len=32, dtype="float32",
                  batch_size=4)
    runs = itertools.count()

    def budgets(ratio: float, cache: str) -> list:
        monkeypatch.setenv(CACHE_ENV, cache)
        manifest = compress(CompressOptions(ratio=ratio, **fields), tmp_path / f"out{next(runs)}", progress=False)
        return manifest["allocation"]["layer_budgets"]

    fresh = budgets(0.4, "")  # set and empty: no cache
    cache = tmp_path / "cache"
    assert budgets(0.6, str(cache)) != fresh
    [kept] = (cache / "asvd-sensitivity").iterdir()
    measured = kept.read_text()
    assert budgets(0.4, str(cache)) == fresh
    reversed_list = json.loads(measured)
    for entry in reversed_list["entries"]:
        entry["loss"] = -entry["loss"]  # the least sensitive matrices now look the most
    kept.write_text(json.dumps(reversed_list))
    assert budgets(0.4, str(cache)) != fresh
    kept.write_text(measured[: len(measured) // 2])  # cut short
    assert budgets(0.4, str(cache)) == fresh
    assert json.loads(kept.read_text()) == json.loads(measured)


def test_the_kept_list_is_named_by_what_the_model_holds(tmp_path):
    """Not by where the model came from: two models of one shape and size differ, a weight changed in
    place changes the name, and only rho may change without changing it."""
    model = tiny_model("gqa", seed=0)
    calib = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    method = make_method("asvd", 0.4, torch.float16)
    name = sensitivity_file(tmp_path, method, model, calib)
    assert sensitivity_file(tmp_path, make_method("asvd", 0.2, torch.float16), copy.deepcopy(model), calib) == name
    changed = copy.deepcopy(model)
    with torch.no_grad():
        next(changed.parameters())[0, 0] += 1
    others = [sensitivity_file(tmp_path, method, tiny_model("gqa", seed=1), calib),
              sensitivity_file(tmp_path, method, changed, calib),
              sensitivity_file(tmp_path, method, model, calib.flip(0)),
              sensitivity_file(tmp_path, make_method("asvd", 0.4, torch.float32), model, calib)]
    assert name not in others and len(set(others)) == len(others)


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_folder() == tmp_path / "mine"
    monkeypatch.setenv(CACHE_ENV, "")
    assert cache_folder() is None
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder() == tmp_path / "xdg" / "ftc"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_folder() == tmp_path / "home" / ".cache" / "ftc"


class _Killed(Exception):
    """Stands for the process dying mid-search."""


_LOSS = sensitivity.loss_from_layer


def _counting_losses(monkeypatch, fail_after: int | None = None) -> list:
    """Counts the candidates measured (each is one `loss_from_layer`); with `fail_after`, the search
    dies at the candidate after that many."""
    calls: list = []

    def counted(*args, **kwargs):
        if fail_after is not None and len(calls) == fail_after:
            raise _Killed
        calls.append(args[2])
        return _LOSS(*args, **kwargs)

    monkeypatch.setattr(sensitivity, "loss_from_layer", counted)
    return calls


def test_a_search_cut_short_resumes_from_its_checkpoint_and_gives_the_same_list(monkeypatch):
    model = _confident("gqa")
    layout = layout_of(model.config)
    calib = _calibration(model)
    method = make_method("asvd", 0.4, torch.float16)
    ratios = (0.2, 0.7)
    run = dict(batch_size=BATCH, progress=False, ratios=ratios)
    whole = sensitivities(method, model, layout, calib, **run)
    kept: list = []
    _counting_losses(monkeypatch, fail_after=11)  # dies in the sixth projection's candidates
    with pytest.raises(_Killed):
        sensitivities(method, model, layout, calib, checkpoint=lambda entries: kept.append(list(entries)), **run)
    assert [len(k) for k in kept] == [2, 4, 6, 8, 10]  # after each projection
    calls = _counting_losses(monkeypatch)
    assert sensitivities(method, model, layout, calib, done=kept[-1], **run) == whole
    assert len(calls) == len(whole) - 10  # only what the checkpoint did not hold
    assert calls[0] == 1  # the first five projections were layer 0's four and layer 1's W_Q


def test_search_budgets_resumes_a_search_cut_short_from_the_cache_folder(monkeypatch, tmp_path):
    """The partial list sits beside where the whole one will be, is read by the next run, which
    plans what an uninterrupted search plans, and is gone once the whole list is kept."""
    model = _confident("gqa", layers=2)
    layout = layout_of(model.config)
    calib = _calibration(model)
    method = make_method("asvd", 0.4, torch.float32)
    fresh = search_budgets(method, model, layout, calib, batch_size=BATCH, progress=False).budgets
    _counting_losses(monkeypatch, fail_after=3 * 9)  # three projections of nine candidates each
    with pytest.raises(_Killed):
        search_budgets(method, model, layout, calib, batch_size=BATCH, progress=False, cache=tmp_path)
    [partial] = (tmp_path / "asvd-sensitivity").iterdir()
    assert partial.name.endswith(".partial.json") and len(json.loads(partial.read_text())["entries"]) == 27
    calls = _counting_losses(monkeypatch)
    assert search_budgets(method, model, layout, calib, batch_size=BATCH, progress=False,
                          cache=tmp_path).budgets == fresh
    assert len(calls) == 2 * 4 * 9 - 27
    [whole] = (tmp_path / "asvd-sensitivity").iterdir()
    assert whole == sensitivity_file(tmp_path, method, model, calib)


def test_an_attention_search_reads_its_candidates_from_a_kept_whole_model_list(monkeypatch, tmp_path):
    """The whole-model list holds every attention candidate, each measured on the original model
    alone: the attention search then measures none and plans what a search of its own plans; from a
    whole-model search cut short it measures only what that one had not reached."""
    model = _confident("gqa", layers=2)
    layout = layout_of(model.config)
    calib = _calibration(model)
    attention = make_method("asvd", 0.4, torch.float32)
    whole_model = make_method("asvd", 0.4, torch.float32, scope="model")
    fresh = search_budgets(attention, model, layout, calib, batch_size=BATCH, progress=False).budgets
    search_budgets(whole_model, model, layout, calib, batch_size=BATCH, progress=False, cache=tmp_path)
    calls = _counting_losses(monkeypatch)
    assert search_budgets(attention, model, layout, calib, batch_size=BATCH, progress=False,
                          cache=tmp_path).budgets == fresh
    assert calls == []
    cut_short = tmp_path / "cut"
    _counting_losses(monkeypatch, fail_after=9 * 9)  # layer 0's seven projections, layer 1's first two
    with pytest.raises(_Killed):
        search_budgets(whole_model, model, layout, calib, batch_size=BATCH, progress=False, cache=cut_short)
    calls = _counting_losses(monkeypatch)
    assert search_budgets(attention, model, layout, calib, batch_size=BATCH, progress=False,
                          cache=cut_short).budgets == fresh
    assert len(calls) == 2 * 9 and set(calls) == {1}  # layer 1's W_V and W_O

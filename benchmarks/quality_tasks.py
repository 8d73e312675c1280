"""`quality.py --part tasks`: downstream accuracy through lm-eval of the dense model and of every
method at each keep ratio, on the paper's six zero-shot tasks (ARC-e, ARC-c, HellaSwag, PIQA,
BoolQ, MathQA). The headline is "avg5", the mean of the five a small model answers by reading;
BoolQ stands beside it with the share of its questions the model answered "yes" (on SmolLM2 its
accuracy follows that share, not the passage), and "avg6", the six, is kept to compare with papers.

Each cell is compressed with `ftc.compression.compress`, written as an artifact, reloaded from disk in its
factorized form and scored by lm-eval on the `ftc_<task>` configs (`ftc.evaluation.downstream`). Every row
uses the same `--limit` (the first N documents of each task); the standard error of each score is
lm-eval's, and that of an average combines its tasks as independent estimates. Each cell also keeps
its per-document scores, so the avg5 gaps to dense and to FTC at the same ratio are paired
differences on the same documents, with the standard error of the paired difference. Finished cells are kept in the
JSON and skipped on re-runs with the same limit, so an interrupted run resumes; each save merges
into the file as it is then, under a lock, so one process per core (different `--methods` or
`--ratios`, the same `--out`) fills one table. Start the second once the first has saved dense.
Writes benchmarks/results/tasks.{json,md,png}.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ftc.compression.compress import CompressOptions, compress
from ftc.evaluation.downstream import average, evaluate_tasks, paired_difference
from ftc.evaluation.tasks import AVG5, AVG6
from ftc.evaluation.tasks.utils import load_boolq
from ftc.runtime.artifact import load_artifact
from service.reports.plots import render_plots
from service.reports.rows import AVERAGE, ResultRow

COLUMNS = {"arc_easy": "ARC-e", "arc_challenge": "ARC-c", "hellaswag": "HellaSwag", "piqa": "PIQA",
           "mathqa": "MathQA"}
"""The avg5 tasks, in the table's order; BoolQ has its own columns after avg5."""
WHY_BOOLQ_APART = (
    "BoolQ is not in the headline: on SmolLM2-135M-Instruct its accuracy follows how often a model answers "
    "\"yes\", not what it read (every cell of `tasks_limit400.md` within 4 points of what its yes share alone "
    "gives a model that ignores the passage), so a compression that tips a model towards \"yes\" gains on it. "
    "It stands beside avg5 with that share (\"BoolQ yes\").")


def score_cell(model, tokenizer, limit: int | None, batch_size: int) -> dict[str, Any]:
    """A model's scores on the six tasks, with the process's threads, torch build and CPU kernels.
    Scoring itself does not depend on them (one FTC artifact scored on one and on two threads gives
    the same answers), but an FTC compression does, and `compressed_cell` compresses in this process:
    on SmolLM2 BoolQ answers follow it (ftc at rho 0.4 compressed on one and on two threads: 55.0%
    and 48.5% on the same 200 documents)."""
    started = time.perf_counter()
    scores = evaluate_tasks(model, tokenizer, AVG6, limit=limit, batch_size=batch_size, per_document=True)
    return {**scores, "eval_seconds": round(time.perf_counter() - started, 1), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpu_kernels": torch.backends.cpu.get_cpu_capability()}


def compressed_cell(loaded, options: CompressOptions, limit: int | None, batch_size: int) -> dict[str, Any]:
    """One method at one ratio: compressed, written, reloaded from disk, scored (`score_cell`)."""
    with tempfile.TemporaryDirectory() as tmp:
        manifest = compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        model, _, _ = load_artifact(Path(tmp) / "artifact")
        cell = score_cell(model, loaded[1], limit, batch_size)
    return {**cell, "compress_seconds": manifest["compress_seconds"],
            "model_reduction": manifest["storage"]["model_reduction"]}


def _percent(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}" + ("" if stderr is None else f" ±{100 * stderr:.1f}")


def _avg5(cell: dict[str, Any]) -> dict[str, float | None]:
    return average({task: cell["tasks"][task] for task in AVG5})


def _gap(cell: dict[str, Any], reference: dict[str, Any] | None) -> str:
    """avg5(cell) - avg5(reference) in points: paired, with its standard error, where both cells
    kept per-document scores; the plain difference for cells measured before they were kept."""
    if reference is None or cell is reference:
        return "-"
    mine, theirs = ({task: c["tasks"][task] for task in AVG5} for c in (cell, reference))
    if all("documents" in row for row in (*mine.values(), *theirs.values())):
        gap = paired_difference(mine, theirs)
        return f"{100 * gap['avg_diff']:+.1f} ±{100 * gap['stderr']:.1f}"
    return f"{100 * (_avg5(cell)['avg'] - _avg5(reference)['avg']):+.1f}"


def boolq_yes(documents: str, labels: Sequence[int]) -> float:
    """Share of the BoolQ documents a model answered "yes" (choice 1), from its per-document scores
    and the labels: a correct answer is the label, a wrong one the other.

    Why: on SmolLM2 BoolQ accuracy follows this share, not reading (dense answers "yes" on 19 of the
    first 200 documents, whose labels are 63.5% "yes"); the column shows where a BoolQ gain comes from.
    """
    answers = [label if score == "1" else 1 - label for score, label in zip(documents, labels, strict=False)]
    return sum(answers) / len(documents)


def render(results: dict[str, Any], model_name: str, methods: Sequence[str], image: str = "",
           boolq_labels: Sequence[int] = ()) -> str:
    """The table: one row per (rho, method) with each avg5 task's acc and avg5, dense first, the
    avg5 gaps to dense and to FTC at the same ratio, then BoolQ with, given `boolq_labels` (document
    order), the share of its answers that were "yes", and avg6; `image` is the plot's file name,
    shown above it."""
    cells = results["cells"]
    limits = {c["limit"] for c in cells.values()} | ({results["dense"]["limit"]} if "dense" in results else set())
    limit = next(iter(limits)) if len(limits) == 1 else None
    scope = f"the first {limit} documents of each task" if limit else "each task's full split"
    whole = results.get("scope") == "model"
    lines = [f"# Downstream accuracy: {model_name}, lm-eval zero-shot", "",
             f"Accuracy (%, lm-eval's `acc`) on {scope} (`--limit {limit}`), ± lm-eval's standard error. "
             "**avg5** (the headline) is the mean of ARC-e, ARC-c, HellaSwag, PIQA and MathQA, avg6 those and "
             "BoolQ (the paper's six, to compare with papers); an average's error is that of a mean of independent "
             "estimates. \"vs dense\" and \"vs ftc\" are avg5 differences in points; with ± they are paired on the "
             "same documents, with the standard error of the paired difference. "
             "Tasks read the local files in `$FTC_DATA_DIR/tasks/` through the shipped `ftc_<task>` configs.", "",
             WHY_BOOLQ_APART, "",
             *([f"![avg5 against rho]({image})", ""] if image else []),
             f"| {'keep (compression)' if whole else 'rho'} | method | " + " | ".join(COLUMNS.values())
             + " | avg5 | vs dense | vs ftc | BoolQ | BoolQ yes | avg6 |",
             "|---|---|" + "---|" * (len(COLUMNS) + 6)]

    def row(label: str, method: str, cell: dict[str, Any]) -> str:
        scores = [_percent(cell["tasks"][t]["acc"], cell["tasks"][t]["acc_stderr"]) for t in COLUMNS]
        ftc = cells.get(f"ftc@{cell['ratio']}") if "ratio" in cell else None
        boolq = cell["tasks"].get("boolq", {})
        documents = boolq.get("documents")
        yes = _percent(boolq_yes(documents, boolq_labels), None) if documents and boolq_labels else "-"
        avg5 = _avg5(cell)
        return f"| {label} | {method} | " + " | ".join(scores) + f" | {_percent(avg5['avg'], avg5['avg_stderr'])} " \
            f"| {_gap(cell, results.get('dense'))} | {_gap(cell, ftc)} " \
            f"| {_percent(boolq.get('acc'), boolq.get('acc_stderr'))} | {yes} " \
            f"| {_percent(cell['avg'], cell['avg_stderr'])} |"

    if "dense" in results:
        lines.append(row("1.0", "dense", results["dense"]))
    for ratio in sorted({c["ratio"] for c in cells.values()}, reverse=True):
        for method in methods:
            if (cell := cells.get(f"{method}@{ratio}")) is not None:
                lines.append(row(f"{ratio} ({100 * (1 - ratio):.0f}%)" if whole else str(ratio), method, cell))
    produced = "; ".join(f"`{command}`" for command in _commands(results)) or "`benchmarks/quality.py --part tasks`"
    lines += ["", "Each cell: `ftc.compress` -> artifact on disk -> reloaded (factorized) -> lm-eval. "
              f"Produced by {produced}.", ""]
    # checks made outside this script (e.g. lm-eval's own `hf` backend on the dense export), kept
    # in the JSON so a re-run's table still carries them
    notes = results.get("notes", [])
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    return "\n".join(lines)


def plot(results: dict[str, Any], model_name: str) -> bytes:
    """avg5 against rho, one line per method and dense dashed: the sweep reports' accuracy panel.
    The panel names the model only (the table beside it says where its weights come from)."""
    model = model_name.split(" (")[0]
    rows = [ResultRow(model=model, method=c["method"], ratio=c["ratio"], status="succeeded",
                      accuracy={AVERAGE: 100 * _avg5(c)["avg"]}) for c in results["cells"].values()]
    dense = {model: {AVERAGE: 100 * _avg5(results["dense"])["avg"]}} if "dense" in results else {}
    limits = {c["limit"] for c in results["cells"].values()}
    scope = f", first {limits.pop()} documents per task" if len(limits) == 1 and None not in limits else ""
    return render_plots(rows, {}, [], f"avg5 (%), lm-eval zero-shot{scope}", AVG5, dense)["plot.png"]


def _commands(results: dict[str, Any]) -> list[str]:
    """The commands that filled the table, oldest first (files written before merging kept one)."""
    return results.get("commands") or ([results["command"]] if "command" in results else [])


def merged(on_disk: dict[str, Any], finished: dict[str, Any], command: str) -> dict[str, Any]:
    """The table file as another process left it, plus the cells this run `finished` (its dense under
    the key "dense", its method cells under theirs), which replace those of the same key; `command`
    joins the commands unless it is already there."""
    results = {**on_disk, "cells": {**on_disk.get("cells", {}), **{k: v for k, v in finished.items() if k != "dense"}}}
    if "dense" in finished:
        results["dense"] = finished["dense"]
    results.pop("command", None)
    results["commands"] = list(dict.fromkeys([*_commands(on_disk), command]))
    return results


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s lock file while its table is read, merged and written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write(path: Path, text: str | bytes) -> None:
    """Atomically: a killed run never leaves a half-written table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text.encode() if isinstance(text, str) else text)
    os.replace(tmp, path)


def methods_in(results: dict[str, Any], first: Sequence[str] = ()) -> list[str]:
    """The rows' methods: `first` (this run's) in their order, then those of earlier runs, FTC's first."""
    rest = {c["method"] for c in results["cells"].values()} - set(first)
    return [*first, *sorted(rest, key=lambda method: (not method.startswith("ftc"), method))]


def rewrite(out: Path, model_name: str) -> None:
    """Write `out`'s table and plot again from its JSON, as the code renders them now."""
    results = json.loads(out.read_text())
    labels = load_boolq("boolq", "validation")["validation"]["label"]
    with _locked(out):
        _write(out.with_suffix(".md"), render(results, model_name, methods_in(results), out.with_suffix(".png").name,
                                              labels))
        _write(out.with_suffix(".png"), plot(results, model_name))


def run_tasks_part(
    loaded,
    base: CompressOptions,
    options_for: Callable[[str, float], CompressOptions],
    methods: Sequence[str],
    ratios: Sequence[float],
    limit: int | None,
    batch_size: int,
    out: Path,
    model_name: str,
) -> None:
    """Fill `out` (JSON) cell by cell: the dense model, then every method at each ratio, in that order."""
    command = " ".join(["benchmarks/quality.py", *sys.argv[1:]])
    results = json.loads(out.read_text()) if out.exists() else {"cells": {}}
    finished: dict[str, Any] = {}

    boolq_labels = load_boolq("boolq", "validation")["validation"]["label"]

    def table() -> str:
        # rows of methods from earlier runs stay in the table, after this run's
        return render(results, model_name, methods_in(results, methods), out.with_suffix(".png").name, boolq_labels)

    def save(key: str, cell: dict[str, Any]) -> None:
        nonlocal results
        finished[key] = cell
        with _locked(out):
            results = merged(json.loads(out.read_text()) if out.exists() else {"cells": {}}, finished, command)
            results["calibration"] = f"{base.calib_samples} x {base.seq_len} tokens of {base.calib}, seed {base.seed}"
            if base.scope != "attention":  # files of attention-only runs name no scope
                results["scope"] = base.scope
            _write(out, json.dumps(results, indent=2))
            _write(out.with_suffix(".md"), table())
            _write(out.with_suffix(".png"), plot(results, model_name))

    if results.get("dense", {}).get("limit", -1) != limit:
        save("dense", score_cell(loaded[0], loaded[1], limit, batch_size))
        print("dense", f"avg5 {_avg5(results['dense'])['avg']:.4f}", flush=True)
    for ratio in ratios:
        for method in methods:
            key = f"{method}@{ratio}"
            if results["cells"].get(key, {}).get("limit", -1) == limit:
                continue
            cell = compressed_cell(loaded, options_for(method, ratio), limit, batch_size)
            save(key, {"method": method, "ratio": ratio, **cell})
            print(key, f"avg5 {_avg5(cell)['avg']:.4f}", flush=True)
    print(table())


if __name__ == "__main__":
    import argparse

    from ftc.models.registry import ALIASES

    parser = argparse.ArgumentParser(description="Write a tasks table (.md, .png) again from its JSON.")
    parser.add_argument("results", type=Path, help="e.g. benchmarks/results/tasks_limit400.json")
    parser.add_argument("--model", default="smollm2-135m", choices=list(ALIASES), help="the model it measured")
    args = parser.parse_args()
    rewrite(args.results, ALIASES[args.model].label)

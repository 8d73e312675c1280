"""The `ftc` command line: `compress`, `eval`, and the service commands (`serve`, `submit`, `jobs`).

Heavy imports (torch, transformers) happen inside the commands so that `ftc serve` and the
client commands start fast and never load them. Every user error ends with one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from .options import ABLATIONS, DEVICES, DTYPES, METHODS, InputError


class UsageError(Exception):
    """A problem with the user's input: reported in one line, exit code 2."""


def _writable_out(out: str) -> Path:
    """Fail before any work if `--out` cannot be created: probe the nearest existing ancestor."""
    import tempfile

    path = Path(out).resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    try:
        with tempfile.NamedTemporaryFile(dir=parent):
            pass
    except OSError:
        raise UsageError(f"--out {out}: {parent} is not writable; choose another folder") from None
    return path


def cmd_compress(args: argparse.Namespace) -> int:
    from .compress import CompressOptions, compress
    from .options import parse_ablations

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
        ).validate()
    except InputError as exc:
        raise UsageError(str(exc)) from None
    _check_inputs(options)
    if args.dry_run:
        from .compress import plan

        print(json.dumps(plan(options), indent=2))
        return 0
    if args.out is None:
        raise UsageError("--out is required (or use --dry-run)")
    out = _writable_out(args.out)
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


def _check_inputs(options) -> None:
    """Resolve the model and dataset names up front, before any expensive loading."""
    from .data import DatasetError, load_text
    from .models import ModelError, pick_device, resolve_model

    try:
        resolve_model(options.model)
        pick_device(options.device)
        load_text(options.calib, "validation")
    except (ModelError, DatasetError) as exc:
        raise UsageError(str(exc)) from None


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from .data import DatasetError, load_text, tokenize
    from .evaluate import perplexity
    from .models import ModelError, load_model, pick_device, resolve_model

    spec = args.model or args.dir
    if spec is None:
        raise UsageError("give an artifact folder or --model NAME")
    try:
        source = resolve_model(spec)
        device = pick_device(args.device)
        text = load_text(args.dataset, "test")
    except (ModelError, DatasetError) as exc:
        raise UsageError(str(exc)) from None
    if args.seq_len < 2 or (args.max_windows is not None and args.max_windows < 1):
        raise UsageError("--seq-len must be >= 2 and --max-windows >= 1")
    model, tokenizer = load_model(source, torch.float32, device)
    result = perplexity(
        model,
        tokenize(tokenizer, text),
        args.seq_len,
        args.max_windows,
        device=device,
        progress=not args.quiet,
    )
    result = {"model": spec, "dataset": args.dataset, **result}
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.dataset} perplexity {result['ppl']:.3f} over {result['windows']} windows of {args.seq_len}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftc", description="Compress LLM attention with FTC.")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compress", help="compress a model into an artifact folder")
    c.add_argument("--model", default="smollm2-135m", help="alias, HF folder, or .gguf file")
    c.add_argument("--method", default="ftc", choices=METHODS)
    c.add_argument("--ratio", type=float, default=0.4, help="keep ratio rho in (0, 1]")
    c.add_argument("--calib", default="wikitext2", help="wikitext2, ptb, or a .txt/.jsonl path")
    c.add_argument("--calib-samples", type=int, default=32)
    c.add_argument("--seq-len", type=int, default=512)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", default="float16", choices=DTYPES, help="storage dtype (the budget unit)")
    c.add_argument("--device", default="auto", choices=DEVICES)
    c.add_argument("--ablate", default="", help=f"comma list of: {', '.join(ABLATIONS)}")
    c.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward")
    c.add_argument("--out", help="artifact folder (written atomically)")
    c.add_argument("--work-dir", help="keep per-layer checkpoints here; re-running resumes from them")
    c.add_argument("--dry-run", action="store_true", help="print the plan (shapes, budgets, memory) and exit")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compress)

    e = sub.add_parser("eval", help="perplexity of an artifact or a model")
    e.add_argument("dir", nargs="?", help="artifact folder")
    e.add_argument("--model", help="a model instead of an artifact (alias, folder, .gguf)")
    e.add_argument("--dataset", default="wikitext2")
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--max-windows", type=int, default=None)
    e.add_argument("--device", default="auto", choices=DEVICES)
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_eval)

    # service commands live with the service; their modules import nothing heavy at import time
    for module in ("service.cli", "workers.cli"):
        try:
            register = importlib.import_module(module).register
        except ModuleNotFoundError:  # the service parts are optional for library users
            continue
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, InputError, FileExistsError) as exc:
        print(f"ftc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ftc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`ftc export DIR --format dense --out OUT`: a compressed artifact as a stock checkpoint.

The dense form loads with plain `from_pretrained` (no custom code) and serves wherever the base
architecture does; it keeps the compressed model's outputs but none of its savings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.common import UsageError, writable_out

FORMATS = ("dense",)
DTYPES = ("float16", "bfloat16", "float32")


def run(args: argparse.Namespace) -> int:
    from ftc.options import InputError
    from ftc.runtime.artifact import ftc_block
    from ftc.runtime.export import export_dense

    source = Path(args.artifact)
    if not source.is_dir():
        raise UsageError(f"DIR {args.artifact} is not a folder; give an artifact folder written by 'ftc compress'")
    if (source / "config.json").is_file() and not (source / "manifest.json").is_file():
        raise UsageError(f"DIR {args.artifact} is a model folder (config.json) but not a compressed artifact (no "
                         "manifest.json); export reads what 'ftc compress' writes, and a dense folder needs no export")
    try:
        ftc_block(source)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    out = writable_out(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"--out {args.out} exists and is not empty; pass --overwrite or pick a new folder")
    summary = export_dense(source, out, dtype=args.dtype, overwrite=args.overwrite)
    print(json.dumps(summary))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    e = subparsers.add_parser("export", help="write a compressed artifact in another format (dense: stock checkpoint)")
    e.add_argument("artifact", metavar="DIR", help="artifact folder written by 'ftc compress'")
    e.add_argument("--format", default="dense", choices=FORMATS,
                   help="dense: the base architecture's own checkpoint, loadable without custom code")
    e.add_argument("--out", required=True, help="output folder (written atomically)")
    e.add_argument("--dtype", choices=DTYPES, help="weight dtype of the export (default: the artifact's)")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    e.set_defaults(func=run)

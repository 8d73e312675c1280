"""`ftc eval`: perplexity of an artifact folder or of a model (the artifact runs factorized)."""

from __future__ import annotations

import argparse
import json

from cli.common import UsageError
from ftc.options import DEVICES


def run(args: argparse.Namespace) -> int:
    import torch

    from ftc.data import DatasetError, load_text, tokenize
    from ftc.evaluate import perplexity
    from ftc.loading import load_model
    from ftc.models import ModelError, pick_device, resolve_model

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
        print(f"{args.dataset} perplexity {result['ppl']:.3f} over {result['windows']} windows of {args.seq_len}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    e = subparsers.add_parser("eval", help="perplexity of an artifact or a model")
    e.add_argument("dir", nargs="?", help="artifact folder")
    e.add_argument("--model", help="a model instead of an artifact (alias, folder, .gguf)")
    e.add_argument("--dataset", default="wikitext2", help="wikitext2, ptb, or a .txt/.jsonl path")
    e.add_argument("--seq-len", type=int, default=512, help="tokens per evaluation window")
    e.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows (default: all)")
    e.add_argument("--device", default="auto", choices=DEVICES, help="where the model runs")
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=run)

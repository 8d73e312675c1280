"""`ftc eval`: perplexity and downstream-task accuracy of an artifact folder or of a model (the
artifact runs factorized). Tasks are scored by lm-evaluation-harness through `ftc.evaluation.downstream`."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from cli.common import UsageError
from ftc.evaluation.tasks import TASK_DIR, parse_tasks
from ftc.options import DEVICES


def _check(args: argparse.Namespace) -> None:
    if args.seq_len < 2 or (args.max_windows is not None and args.max_windows < 1):
        raise UsageError("--seq-len must be >= 2 and --max-windows >= 1")
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be >= 1 (documents per task)")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UsageError("--num-fewshot must be >= 0")
    if args.batch_size < 1:
        raise UsageError("--batch-size must be >= 1")


def run(args: argparse.Namespace) -> int:
    if args.task_dir:
        print(TASK_DIR)
        return 0
    import torch

    from ftc.evaluation.data import DatasetError, bos_prefix, load_text, tokenize
    from ftc.evaluation.tasks import task_file
    from ftc.models.registry import ModelError, pick_device, resolve_model
    from ftc.models.weights import check_gguf
    from ftc.runtime.loading import load_model

    if args.model and args.dir:
        raise UsageError(f"give an artifact folder or --model, not both (DIR {args.dir} and --model {args.model})")
    spec = args.model or args.dir
    if spec is None:
        raise UsageError("give an artifact folder or --model NAME")
    _check(args)
    tasks = parse_tasks(args.tasks)
    if args.tasks is not None and not tasks:
        raise UsageError("--tasks names no task; give e.g. --tasks arc_easy,piqa or --tasks avg6")
    if not tasks and (args.limit is not None or args.num_fewshot is not None):
        raise UsageError("--limit and --num-fewshot apply to tasks; add --tasks (e.g. --tasks avg6)")
    dataset = args.dataset or (None if tasks else "wikitext2")
    for task in tasks:  # a missing data file fails before the model is loaded
        task_file(task)
    try:
        source = resolve_model(spec)
        if source.kind == "gguf":
            check_gguf(source.path / source.gguf_file)
        device = pick_device(args.device)
        text = load_text(dataset, "test") if dataset else None
    except (ModelError, DatasetError) as exc:
        raise UsageError(str(exc)) from None
    model, tokenizer = load_model(source, torch.float32, device)
    result: dict[str, Any] = {"model": spec}
    if text is not None:
        from ftc.evaluation.evaluate import perplexity

        ids = tokenize(tokenizer, text)
        result |= {"dataset": dataset, **perplexity(model, ids, args.seq_len, args.max_windows, device=device,
                                                     progress=not args.quiet, prefix=bos_prefix(tokenizer))}
    if tasks:
        from ftc.evaluation.downstream import evaluate_tasks

        if args.quiet:
            logging.getLogger("lm_eval").setLevel(logging.ERROR)
        result |= evaluate_tasks(model, tokenizer, tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                                 batch_size=args.batch_size)
    if args.json:
        print(json.dumps(result))
    else:
        _print_text(result, args.seq_len)
    return 0


def _score(value: float, stderr: float | None) -> str:
    return f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")


def _print_text(result: dict[str, Any], seq_len: int) -> None:
    if "ppl" in result:
        print(f"{result['dataset']} perplexity {result['ppl']:.3f} over {result['windows']} windows of {seq_len}")
    for task, row in result.get("tasks", {}).items():
        if "exact_match" in row:
            print(f"{task:14s} exact_match {_score(row['exact_match'], row['exact_match_stderr'])}  n={row['n']}")
        else:
            norm = "" if row["acc_norm"] is None else f"  acc_norm {row['acc_norm']:.4f}"
            print(f"{task:14s} acc {_score(row['acc'], row['acc_stderr'])}{norm}  n={row['n']}")
    if "avg" in result:
        print(f"{'avg':14s} {_score(result['avg'], result['avg_stderr'])}")


def register(subparsers: argparse._SubParsersAction) -> None:
    e = subparsers.add_parser("eval", help="perplexity and downstream accuracy of an artifact or a model")
    e.add_argument("dir", nargs="?", help="artifact folder")
    e.add_argument("--model", help="a model instead of an artifact (alias, folder, .gguf)")
    e.add_argument("--dataset", default=None,
                   help="perplexity on wikitext2, ptb, or a .txt/.jsonl path (default: wikitext2 unless --tasks)")
    e.add_argument("--seq-len", type=int, default=512, help="tokens per evaluation window")
    e.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows (default: all)")
    e.add_argument("--tasks", help="downstream tasks through lm-eval, comma-separated (arc_easy,piqa,...), "
                   "avg6 for the paper's six; data from $FTC_DATA_DIR/tasks")
    e.add_argument("--limit", type=int, default=None, help="score the first N documents of each task (default: all)")
    e.add_argument("--num-fewshot", type=int, default=None,
                   help="few-shot examples per prompt (default: each task's own, 0; 5 for gsm8k)")
    e.add_argument("--batch-size", type=int, default=1, help="documents per forward pass for tasks")
    e.add_argument("--task-dir", action="store_true",
                   help="print the folder of the shipped task configs (for lm_eval --include_path) and exit")
    e.add_argument("--device", default="auto", choices=DEVICES, help="where the model runs")
    e.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=run)

"""Generation a person can read: greedy answers of the dense model and of every method at every
rho to 50 short prompts (benchmarks/data/prompts.jsonl), and lm-eval's GSM8K.

    .venv/bin/python benchmarks/generation.py                        # SmolLM2-135M, the whole grid
    .venv/bin/python benchmarks/generation.py --model gemma3-270m    # needs `make models`
    .venv/bin/python benchmarks/generation.py --methods ftc --ratios 0.4 --prompts 3 --gsm8k-limit 2 \\
        --out /tmp/generation_smoke.json                             # a smoke run, a few minutes

Why: a compression can keep perplexity low and still answer in gibberish (a known failure of
low-rank compression); these are answers a person reads. Each prompt goes through the model's chat
template where its tokenizer has one (SmolLM2-135M-Instruct), else as `Question: ...\\nAnswer:` cut
at the first line break (Gemma-3-270M is a base model). Greedy, at most `--max-new-tokens` tokens.

Scores per cell, against the dense model's answers to the same prompts:
- exact: the answer is the dense model's, character for character (spaces at the ends aside);
- prefix: after normalising (lower case, punctuation dropped, spaces collapsed) one answer starts
  with the other and neither is empty, so a shorter or a longer version of the same answer counts;
- correct: one of the prompt's accepted answers appears in it as whole words (dense has this too);
- GSM8K: lm-eval's `gsm8k` (the shipped `ftc_gsm8k` config: 5-shot, strict `#### n` match and the
  flexible last-number match) on the first `--gsm8k-limit` problems.

Cells are those of `benchmarks/quality.py` (same methods, ratios, options, `--scope`), each
compressed through `ftc.compression.compress`, written as an artifact, reloaded from disk and asked. Finished
cells are kept and skipped on re-runs, so an interrupted run resumes; a file of other prompts (by
sha256), token limit or GSM8K limit is refused rather than mixed.
Writes benchmarks/results/generation_<model>[_model_scope].{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from quality import (
    CALIBRATION_SAMPLES,
    METHODS,
    MODEL_SCOPE_RATIOS,
    RESULTS,
    VARIANTS,
    _write,
    cell_key,
    methods_of_scope,
    model_label,
    results_file,
)

from ftc.compression.compress import CompressOptions, compress
from ftc.evaluation.downstream import evaluate_tasks
from ftc.models.registry import resolve_model
from ftc.options import MODEL_ALIASES, SCOPES
from ftc.runtime.artifact import load_artifact
from ftc.runtime.loading import load_model

PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
MAX_NEW_TOKENS = 32
GSM8K_LIMIT = 50
"""GSM8K problems per cell: up to 256 generated tokens each after a 5-shot prompt, the slowest part."""
EXAMPLES = 6
"""Prompts shown with every method's answer side by side in the Markdown (the first of each kind, then
the next ones in file order)."""


def read_prompts(path: Path, count: int | None = None) -> tuple[list[dict[str, Any]], str]:
    """The first `count` prompts (all: None) and the sha256 of exactly what was read."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:count]
    return [json.loads(line) for line in lines], hashlib.sha256("\n".join(lines).encode()).hexdigest()


def prompt_ids(tokenizer, prompt: str) -> tuple[torch.Tensor, bool]:
    """The prompt's token ids (1 x n), and whether they went through the chat template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids, True
    return tokenizer(f"Question: {prompt}\nAnswer:", return_tensors="pt").input_ids, False


@torch.no_grad()
def answer(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """The model's greedy answer: the new tokens up to end of sequence; without a chat template, up
    to the first line break too (a base model goes on with the next question)."""
    ids, chat = prompt_ids(tokenizer, prompt)
    eos = tokenizer.eos_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         temperature=None, top_p=None, top_k=None, eos_token_id=eos,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return (text if chat else text.split("\n", 1)[0]).strip()


def normalised(text: str) -> str:
    """Lower case, punctuation dropped, spaces collapsed: what the prefix and correct scores compare."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def prefix_match(answer_text: str, reference: str) -> bool:
    """One normalised answer starts the other (on a word boundary), and neither is empty."""
    a, b = normalised(answer_text), normalised(reference)
    shorter, longer = sorted((a, b), key=len)
    return bool(shorter) and (longer == shorter or longer.startswith(shorter + " "))


def correct(answer_text: str, accepted: list[str]) -> bool:
    """One of the accepted answers appears in the answer as whole words, case and punctuation aside."""
    padded = f" {normalised(answer_text)} "
    return any(f" {normalised(option)} " in padded for option in accepted)


def scores(answers: list[str], dense: list[str] | None, prompts: list[dict[str, Any]]) -> dict[str, float]:
    """Shares of the prompts: correct, and (given the dense model's answers) exact and prefix agreement."""
    n = len(answers)
    found = {"correct": sum(correct(a, p["answers"]) for a, p in zip(answers, prompts, strict=True)) / n}
    if dense is not None:
        found["exact"] = sum(a.strip() == d.strip() for a, d in zip(answers, dense, strict=True)) / n
        found["prefix"] = sum(prefix_match(a, d) for a, d in zip(answers, dense, strict=True)) / n
    return found


def asked(model, tokenizer, prompts: list[dict[str, Any]], max_new_tokens: int, gsm8k_limit: int,
          batch_size: int) -> dict[str, Any]:
    """Every prompt's answer and the GSM8K scores of one model, with the time each took."""
    started = time.perf_counter()
    answers = [answer(model, tokenizer, p["prompt"], max_new_tokens) for p in prompts]  # none: GSM8K only
    answer_seconds = time.perf_counter() - started
    cell: dict[str, Any] = {"answers": answers, "answer_seconds": round(answer_seconds, 1)}
    if gsm8k_limit:
        started = time.perf_counter()
        gsm8k = evaluate_tasks(model, tokenizer, ["gsm8k"], limit=gsm8k_limit, batch_size=batch_size)
        cell["gsm8k"] = {**gsm8k["tasks"]["gsm8k"], "seconds": round(time.perf_counter() - started, 1)}
    return cell


def compressed(loaded, options: CompressOptions, prompts, max_new_tokens: int, gsm8k_limit: int,
               batch_size: int) -> dict[str, Any]:
    """One method at one ratio: compressed, written, reloaded from disk and asked (`asked`)."""
    with tempfile.TemporaryDirectory() as tmp:
        manifest = compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        model, _, _ = load_artifact(Path(tmp) / "artifact")
        cell = asked(model, loaded[1], prompts, max_new_tokens, gsm8k_limit, batch_size)
    return {**cell, "compress_seconds": manifest["compress_seconds"],
            "linear_reduction": manifest["storage"].get("linear_reduction"),
            "model_reduction": manifest["storage"]["model_reduction"]}


def added_gsm8k(loaded, options: CompressOptions, gsm8k_limit: int, batch_size: int) -> dict[str, Any]:
    """GSM8K for a cell of an earlier run that had none, from a new compression with the same options
    (that run's artifact is gone); marked `recompressed`, its answers to the prompts stay as they were."""
    with tempfile.TemporaryDirectory() as tmp:
        compress(options, Path(tmp) / "artifact", loaded=loaded, progress=False)
        model, _, _ = load_artifact(Path(tmp) / "artifact")
        cell = asked(model, loaded[1], [], 0, gsm8k_limit, batch_size)
    return {**cell["gsm8k"], "recompressed": True}


def _cell(text: str) -> str:
    """An answer inside a Markdown table cell: pipes escaped, line breaks shown, empty made visible."""
    return (text.replace("|", "\\|").replace("\n", " ⏎ ") or "(empty)").strip()


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}"


def example_indices(prompts: list[dict[str, Any]], count: int = EXAMPLES) -> list[int]:
    """The first prompt of each kind, then the next ones in file order, `count` in all."""
    first = list(dict.fromkeys(p["kind"] for p in prompts))
    chosen = [next(i for i, p in enumerate(prompts) if p["kind"] == kind) for kind in first]
    chosen += [i for i in range(len(prompts)) if i not in chosen]
    return sorted(chosen[:count])


def render(results: dict[str, Any], prompts: list[dict[str, Any]], quality: dict[str, Any]) -> str:
    """The table of every cell's scores (with its WikiText-2 perplexity from `quality`, the
    perplexity results of the same model and scope, where it has the cell), then example answers."""
    dense, cells = results.get("dense"), results["cells"]
    whole = results.get("scope") == "model"
    head = "keep (compression)" if whole else "rho"
    limit = results.get("gsm8k_limit")
    lines = [f"# Generation: {model_label(results['model'])}", "",
             f"Greedy answers (at most {results['max_new_tokens']} new tokens) to the {len(prompts)} prompts of "
             f"`benchmarks/data/prompts.jsonl` (sha256 `{results['prompts_sha256'][:12]}`), {results['format']}. "
             "**exact**: the dense model's answer, character for character; **prefix**: after lower-casing and "
             "dropping punctuation one answer starts the other; **correct**: an accepted answer appears in it as "
             "whole words. All in % of the prompts. "
             + (f"GSM8K: lm-eval's `gsm8k` (5-shot, the shipped `ftc_gsm8k` config), exact match in % on the first "
                f"{limit} problems, strict (`#### n`) / flexible (last number). " if limit else "")
             + "WikiText-2: the cell's perplexity in the perplexity results of the same model and scope "
             "(`benchmarks/quality.py`), where it has been measured.", "",
             f"| {head} | method | exact | prefix | correct | GSM8K strict / flexible | WikiText-2 |",
             "|---|---|---|---|---|---|---|"]

    def gsm8k(cell: dict[str, Any]) -> str:
        found = cell.get("gsm8k")
        if not found:
            return "-"
        mark = " °" if found.get("recompressed") else ""
        return f"{100 * found['exact_match']:.0f} / {100 * found['flexible_exact_match']:.0f}{mark}"

    quality_cells = quality.get("cells", {})
    if dense:
        ppl = quality.get("dense", {}).get("ppl")
        lines.append(f"| 1.0 | dense | 100 | 100 | {_percent(dense['correct'])} | {gsm8k(dense)} "
                     f"| {f'{ppl:.2f}' if ppl else '-'} |")
    ratios = sorted({c["ratio"] for c in cells.values()}, reverse=True)
    order = [m for m in METHODS if any(c["method"] == m for c in cells.values())]
    for ratio in ratios:
        for method in order:
            if (cell := cells.get(cell_key(method, ratio))) is None:
                continue
            label = f"{ratio} ({100 * (1 - ratio):.0f}%)" if whole else str(ratio)
            ppl = quality_cells.get(cell_key(method, ratio), {}).get("ppl")
            lines.append(f"| {label} | {method} | {_percent(cell.get('exact'))} | {_percent(cell.get('prefix'))} "
                         f"| {_percent(cell['correct'])} | {gsm8k(cell)} | {f'{ppl:.2f}' if ppl else '-'} |")
    if dense and cells:
        lines += ["", "## Example answers", "",
                  "The same prompts, the dense model's answer first, then each method's at each ratio.", ""]
        for index in example_indices(prompts):
            prompt = prompts[index]
            lines += [f"**{prompt['prompt']}** (accepted: {', '.join(prompt['answers'])})", "",
                      f"| {head} | method | answer |", "|---|---|---|",
                      f"| 1.0 | dense | {_cell(dense['answers'][index])} |"]
            for ratio in ratios:
                for method in order:
                    if (cell := cells.get(cell_key(method, ratio))) is not None:
                        lines.append(f"| {ratio} | {method} | {_cell(cell['answers'][index])} |")
            lines.append("")
    if any(c.get("gsm8k", {}).get("recompressed") for c in cells.values()):
        lines += ["", "° GSM8K measured after the cell's answers, on an artifact compressed again with the same "
                  "options (the first was not kept; FTC's compression depends on float rounding)."]
    commands = "; ".join(f"`{c}`" for c in results.get("commands", []))
    lines += ["", "Each cell: `ftc.compress` -> artifact on disk -> reloaded -> asked. "
              f"Produced by {commands or '`benchmarks/generation.py`'}.", ""]
    return "\n".join(lines)


def generation_file(model: str, scope: str) -> Path:
    return RESULTS / (f"generation_{model}" + ("_model_scope" if scope == "model" else "") + ".json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=MODEL_ALIASES,
                        help="built-in model (gemma3-270m: `make models`)")
    parser.add_argument("--scope", default="attention", choices=SCOPES,
                        help="what rho keeps: the attention projections, or all seven linear projections (model)")
    parser.add_argument("--methods", nargs="*", default=None, help="default: every method that runs in the scope")
    parser.add_argument("--ratios", type=float, nargs="*", default=None,
                        help="default: 0.8 0.6 0.4 0.2; with --scope model 0.8 0.6 0.4")
    parser.add_argument("--prompts", type=int, default=None, help="ask only the first N prompts (default: all 50)")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    parser.add_argument("--gsm8k-limit", type=int, default=GSM8K_LIMIT,
                        help="GSM8K problems per cell (0: no GSM8K); needs FTC_DATA_DIR/tasks/gsm8k_test.jsonl")
    parser.add_argument("--gsm8k-methods", nargs="*", default=None,
                        help="cells that also run GSM8K, by method (default: every method asked)")
    parser.add_argument("--gsm8k-ratios", type=float, nargs="*", default=None,
                        help="cells that also run GSM8K, by ratio (default: every ratio asked); a cell of an earlier "
                             "run without GSM8K gets it from a new compression")
    parser.add_argument("--gsm8k-batch-size", type=int, default=8, help="GSM8K problems per generation batch")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default: benchmarks/results/generation_<model>[_model_scope].json)")
    args = parser.parse_args()
    allowed = methods_of_scope(list(METHODS), args.scope)
    methods = args.methods or allowed
    if refused := [m for m in methods if m not in allowed]:
        parser.error(f"--methods {' '.join(refused)}: not a method of quality.py that runs with --scope {args.scope}")
    ratios = args.ratios or list(MODEL_SCOPE_RATIOS if args.scope == "model" else (0.8, 0.6, 0.4, 0.2))
    if (args.prompts is not None and args.prompts < 1) or args.max_new_tokens < 1 or args.gsm8k_limit < 0:
        parser.error("--prompts and --max-new-tokens must be >= 1, --gsm8k-limit >= 0")
    torch.manual_seed(0)
    out = args.out or generation_file(args.model, args.scope)
    prompts, sha = read_prompts(PROMPTS, args.prompts)
    settings = {"prompts_sha256": sha, "max_new_tokens": args.max_new_tokens, "gsm8k_limit": args.gsm8k_limit}
    results = json.loads(out.read_text()) if out.exists() else {"cells": {}}
    if changed := [k for k, v in settings.items() if results.get(k, v) != v]:  # never mix two settings in a table
        parser.error(f"{out} holds results with another {', '.join(changed)}; give --out for a new file")
    command = " ".join(["benchmarks/generation.py", *sys.argv[1:]])
    results |= {"model": args.model, "scope": args.scope, **settings,
                "commands": list(dict.fromkeys([*results.get("commands", []), command])),
                "calibration": f"{CALIBRATION_SAMPLES} x 512 tokens of the WikiText-2 validation file, seed 0"}
    quality_path = results_file("quality", args.model, args.scope)
    quality = json.loads(quality_path.read_text()) if quality_path.exists() else {}

    base = CompressOptions(model=args.model, scope=args.scope, device="cpu", calib_samples=CALIBRATION_SAMPLES,
                           seq_len=512, seed=0)
    source = resolve_model(base.model)
    model, tokenizer = load_model(source)
    loaded = (model, tokenizer, source)
    results["format"] = ("the tokenizer's chat template" if getattr(tokenizer, "chat_template", None)
                         else "as `Question: ...\\nAnswer:`, cut at the first line break")

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(out, json.dumps(results, indent=2))
        _write(out.with_suffix(".md"), render(results, prompts, quality))

    if "dense" not in results:
        dense = asked(model, tokenizer, prompts, args.max_new_tokens, args.gsm8k_limit, args.gsm8k_batch_size)
        results["dense"] = {**dense, **scores(dense["answers"], None, prompts)}
        save()
        print("dense", f"correct {results['dense']['correct']:.2f}", flush=True)
    for ratio in ratios:
        for method in methods:
            key = cell_key(method, ratio)
            options = CompressOptions(**{**base.__dict__, "method": method, "ratio": ratio,
                                         **VARIANTS.get(method, {})})
            gsm8k = args.gsm8k_limit if (method in (args.gsm8k_methods or methods)
                                         and ratio in (args.gsm8k_ratios or ratios)) else 0
            if (found := results["cells"].get(key)) is not None:
                if gsm8k and "gsm8k" not in found:
                    found["gsm8k"] = added_gsm8k(loaded, options, gsm8k, args.gsm8k_batch_size)
                    save()
                continue
            cell = compressed(loaded, options, prompts, args.max_new_tokens, gsm8k, args.gsm8k_batch_size)
            results["cells"][key] = {"method": method, "ratio": ratio, **cell,
                                     **scores(cell["answers"], results["dense"]["answers"], prompts),
                                     "threads": torch.get_num_threads(), "torch": torch.__version__}
            save()
            found = results["cells"][key]
            print(key, f"exact {found['exact']:.2f} prefix {found['prefix']:.2f} correct {found['correct']:.2f}",
                  flush=True)
    print(render(results, prompts, quality))


if __name__ == "__main__":
    main()

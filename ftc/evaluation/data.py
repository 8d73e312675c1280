"""Text sources for calibration and evaluation, and their tokenisation.

WikiText-2 ships with the package (see `ftc/evaluation/data/README.md`), so the default job runs offline.
PTB and other files are read from `FTC_DATA_DIR` (default: a `shared/data` folder beside the
checkout when present). Any `.txt` or `.jsonl` (`text` field) path works too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ftc.options import DATASETS, InputError, dataset_split_problem

PACKAGE_DATA = Path(__file__).parent / "data"
SPLITS = ("test", "validation")


class DatasetError(InputError):
    pass


def data_dir() -> Path | None:
    """Where optional datasets live: `$FTC_DATA_DIR`, else `../shared/data` next to the checkout."""
    if env := os.environ.get("FTC_DATA_DIR"):
        return Path(env)
    for base in (Path(__file__).resolve().parents[2], Path.cwd()):
        candidate = base.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return None


def _rows_as_text(lines: list[str]) -> str:
    """Hugging Face row layout: blank lines (`" "`) become empty rows, rows joined by blank lines."""
    return "\n\n".join("" if line.strip() == "" else line for line in lines)


def _read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _file_text(path: Path) -> str:
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if "text" not in record:
                    raise DatasetError(f"{path}:{n}: JSONL records need a 'text' field")
                rows.append(str(record["text"]))
        return "\n\n".join(rows)
    return path.read_text(encoding="utf-8")


TUNE_FIRST_ARTICLE = " = Military history of Australia = "
"""Where WikiText-2's validation file splits in two (a whole-article boundary, at 70% of its text):
calibration windows are drawn from the articles before it, `wikitext2-tune`'s evaluation windows are
the articles from it on. Every constant and design of the method is chosen on `wikitext2-tune`, so
the test file is read only for reported tables (ftc-method.md §16)."""


def _validation_parts(name: str) -> tuple[list[str], list[str]]:
    """The lines of a WikiText-2 validation file before and from `TUNE_FIRST_ARTICLE`. The raw and
    the tokenized file have the same lines (the tokenized one with `<unk>` for rare words), so both
    split at the same heading."""
    lines = _read_lines(PACKAGE_DATA / name)
    cut = lines.index(TUNE_FIRST_ARTICLE)
    return lines[:cut], lines[cut:]


def load_text(dataset: str, split: str = "test") -> str:
    """The raw text of `dataset` for `split` ("test" for evaluation, "validation" for calibration).

    `wikitext2`: the raw test file to evaluate; to calibrate, the raw validation file's articles
    before `TUNE_FIRST_ARTICLE`, the same format as the test file. `wikitext2-tune`: the rest of the
    raw validation file, for evaluation only (choosing constants without reading the test file).
    `wikitext2-tokenized`: calibration from the tokenized variant of the same articles (rare words
    as `<unk>`), the text calibration read before, kept to compare. `ptb` from `FTC_DATA_DIR`; any
    `.txt`/`.jsonl` path.
    """
    if split not in SPLITS:
        raise DatasetError(f"split must be one of {SPLITS}; got {split!r}")
    if problem := dataset_split_problem(dataset, split):
        raise DatasetError(problem)
    if dataset == "wikitext2":
        if split == "test":
            return _rows_as_text(_read_lines(PACKAGE_DATA / "wiki.test.raw"))
        return _rows_as_text(_validation_parts("wiki.valid.raw")[0])
    if dataset == "wikitext2-tune":
        return _rows_as_text(_validation_parts("wiki.valid.raw")[1])
    if dataset == "wikitext2-tokenized":
        return _rows_as_text(_validation_parts("wiki.valid.tokens")[0])
    if dataset == "ptb":
        root = data_dir()
        path = root / "ptb" / f"ptb.{'test' if split == 'test' else 'valid'}.txt" if root else None
        if path is None or not path.is_file():
            raise DatasetError("dataset 'ptb' needs FTC_DATA_DIR pointing at a folder with ptb/ptb.test.txt")
        return "\n\n".join(line.strip() for line in _read_lines(path))
    path = Path(dataset)
    if path.suffix in (".txt", ".jsonl", ".raw", ".tokens") and path.is_file():
        return _file_text(path)
    if path.suffix in (".txt", ".jsonl", ".raw", ".tokens"):
        raise DatasetError(f"dataset file {dataset} does not exist; give the path of a .txt or .jsonl file")
    raise DatasetError(f"unknown dataset {dataset!r}; use {', '.join(DATASETS)}, or a path to a .txt/.jsonl file")


def calibration_text(dataset: str) -> str:
    """What calibration on `dataset` reads, in words, for the manifest."""
    before = f"articles before '{TUNE_FIRST_ARTICLE.strip(' =')}'"
    return {"wikitext2": f"WikiText-2 raw validation file, {before}",
            "wikitext2-tokenized": f"WikiText-2 tokenized validation file (<unk>), {before}",
            "ptb": "PTB validation file"}.get(dataset, f"file {dataset}")


def text_chunks(text: str, size: int = 1 << 16, separator: str = "\n\n"):
    """Pieces of about `size` characters, each cut where a whole whitespace run before a row begins.

    Byte-level BPE pre-tokenises a complete whitespace run and the word after it the same way
    whatever comes before, so the pieces tokenise to the ids of the whole text (a test checks
    this on the shipped files) without the tokenizer's transient memory for a megabyte string.
    """
    start = 0
    while start < len(text):
        cut = text.find(separator, start + size)
        if cut < 0:
            yield text[start:]
            return
        while cut > start + 1 and text[cut - 1].isspace():  # never split a whitespace run
            cut -= 1
        yield text[start:cut]
        start = cut


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """All token ids of `text` as one 1-D tensor (no special tokens: windows are cut from it)."""
    ids: list[int] = []
    for piece in text_chunks(text):
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def bos_prefix(tokenizer) -> tuple[int, ...]:
    """The tokens the tokenizer puts before every text by default (Gemma's `<bos>`; none for SmolLM2).

    Windows cut from the middle of a text start with them too, for calibration and perplexity alike:
    a model that always saw them first is far off its distribution without them (Gemma-3-270M, 8
    WikiText-2 test windows: perplexity 69.0 without `<bos>`, 24.3 with it), and lm-eval's requests
    carry them already.
    """
    text = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    starts = [i for i in range(len(full) - len(text) + 1) if full[i : i + len(text)] == text]
    return tuple(full[: starts[0]]) if starts else ()


def calibration_ids(ids: torch.Tensor, samples: int, seq_len: int, seed: int,
                    prefix: tuple[int, ...] = ()) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens at seeded random offsets (the GPTQ/SVD-LLM recipe), each
    `prefix` (`bos_prefix`) followed by `seq_len - len(prefix)` tokens of the text."""
    length = seq_len - len(prefix)
    if ids.numel() <= length:
        raise DatasetError(f"calibration text has {ids.numel()} tokens; need more than seq_len={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - length, (samples,), generator=gen)
    head = torch.tensor(prefix, dtype=ids.dtype)
    return torch.stack([torch.cat([head, ids[s : s + length]]) for s in starts.tolist()])


def ids_sha256(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()

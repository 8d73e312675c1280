"""Datasets: the shipped WikiText-2 files, file inputs, tokenisation and calibration sampling."""

from __future__ import annotations

import json

import pytest
import torch

from ftc.evaluation.data import (
    PACKAGE_DATA,
    DatasetError,
    bos_prefix,
    calibration_ids,
    ids_sha256,
    load_text,
    text_chunks,
    tokenize,
)
from ftc.evaluation.evaluate import perplexity
from tests.support.tiny import tiny_model


def test_wikitext_rows_follow_the_hugging_face_layout():
    text = load_text("wikitext2", "test")
    assert text.startswith("\n\n = Robert Boulter = \n\n")  # first row empty, rows joined by blank lines
    assert "<unk>" not in text


def test_calibration_reads_raw_text_and_the_tuning_split_the_articles_it_leaves_out():
    calib, tune = load_text("wikitext2", "validation"), load_text("wikitext2-tune", "test")
    tokenized = load_text("wikitext2-tokenized", "validation")
    assert "<unk>" not in calib  # the format of the test file
    assert "<unk>" in tokenized  # the variant calibration used to read
    assert tune.startswith(" = Military history of Australia = ")
    # the two parts are the whole raw validation file, split once at an article's first line
    raw = (PACKAGE_DATA / "wiki.valid.raw").read_text(encoding="utf-8").splitlines()
    assert len(calib.split("\n\n")) + len(tune.split("\n\n")) == len(raw)
    assert calib.count("\n = ") + tune.count("\n = ") + 1 == sum(line.startswith(" = ") for line in raw)
    assert 0.25 < len(tune) / (len(calib) + len(tune)) < 0.35
    # the same articles in both variants
    assert tokenized.count("\n\n") == calib.count("\n\n")
    with pytest.raises(DatasetError, match="calibrate on wikitext2"):
        load_text("wikitext2-tune", "validation")
    with pytest.raises(DatasetError, match="calibration set only"):
        load_text("wikitext2-tokenized", "test")


@pytest.mark.parametrize("split", ["test", "validation"])
def test_chunked_tokenisation_equals_tokenising_the_whole_text(smollm2_tokenizer, split):
    text = load_text("wikitext2", split)
    assert len(list(text_chunks(text))) > 10
    whole = smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenize(smollm2_tokenizer, text).tolist() == whole


def test_text_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    assert load_text(str(tmp_path / "a.txt")) == "hello world"
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert load_text(str(tmp_path / "b.jsonl")) == "one\n\ntwo"
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DatasetError, match="'text' field"):
        load_text(str(tmp_path / "c.jsonl"))
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_text("c4")
    with pytest.raises(DatasetError, match=r"dataset file .*missing\.jsonl does not exist"):
        load_text(str(tmp_path / "missing.jsonl"), "validation")


def test_ptb_is_read_from_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FTC_DATA_DIR", str(tmp_path))
    with pytest.raises(DatasetError, match="FTC_DATA_DIR"):
        load_text("ptb")
    (tmp_path / "ptb").mkdir()
    (tmp_path / "ptb" / "ptb.test.txt").write_text(" a b \n c d \n")
    assert load_text("ptb") == "a b\n\nc d"


def test_calibration_windows_are_seeded():
    ids = torch.arange(10_000)
    a, b, c = calibration_ids(ids, 4, 128, 0), calibration_ids(ids, 4, 128, 0), calibration_ids(ids, 4, 128, 1)
    assert a.shape == (4, 128) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a[0], torch.arange(int(a[0, 0]), int(a[0, 0]) + 128))
    assert ids_sha256(a) == ids_sha256(b) != ids_sha256(c)


class _Tokenizer:
    """A tokenizer's call convention (`add_special_tokens`) with chosen special tokens around the text."""

    def __init__(self, before: list[int], after: list[int]) -> None:
        self.before, self.after = before, after

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [ord(c) for c in text]
        return {"input_ids": self.before + ids + self.after if add_special_tokens else ids}


def test_bos_prefix_is_what_the_tokenizer_puts_before_a_text(smollm2_tokenizer):
    assert bos_prefix(smollm2_tokenizer) == ()  # SmolLM2 adds nothing: its windows are unchanged
    assert bos_prefix(_Tokenizer([2], [])) == (2,)  # Gemma's <bos>
    assert bos_prefix(_Tokenizer([2], [1])) == (2,)  # an end token is not a prefix
    assert bos_prefix(_Tokenizer([], [1])) == ()


def test_calibration_windows_start_with_the_prefix_then_text():
    ids = torch.arange(100, 10_100)
    plain, prefixed = calibration_ids(ids, 4, 128, 0), calibration_ids(ids, 4, 128, 0, (7,))
    assert prefixed.shape == plain.shape == (4, 128)
    assert prefixed[:, 0].tolist() == [7] * 4
    for row in prefixed:  # then 127 consecutive tokens of the text
        assert torch.equal(row[1:], torch.arange(int(row[1]), int(row[1]) + 127))


def test_perplexity_scores_the_same_tokens_after_the_prefix():
    model = tiny_model("gemma3", vocab_size=64).eval()
    ids = torch.randint(3, 64, (3 * 16,), generator=torch.Generator().manual_seed(0))
    got = perplexity(model, ids, 16, progress=False, batch_size=2, prefix=(1,))
    windows = torch.cat([torch.ones(3, 1, dtype=torch.long), ids.view(3, 16)], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=windows).logits.float(), dim=-1)
    # positions 1..15 of each window predict its tokens 2..16: the tokens scored without a prefix
    nll = -logp[:, 1:-1].gather(-1, windows[:, 2:, None]).mean()
    assert got["ppl"] == pytest.approx(float(nll.exp()), rel=1e-5)
    plain = perplexity(model, ids, 16, progress=False, batch_size=2)
    assert plain["ppl"] != pytest.approx(got["ppl"], rel=1e-3)


def test_compression_calibrates_on_windows_after_the_tokenizers_prefix():
    from ftc.compression.compress import CompressOptions, calibration_batch

    options = CompressOptions(model="unused", calib_samples=3, seq_len=32)
    assert calibration_batch(_Tokenizer([2], []), options, hidden=8)[:, 0].tolist() == [2, 2, 2]
    plain = calibration_batch(_Tokenizer([], []), options, hidden=8)
    assert torch.equal(plain, calibration_ids(tokenize(_Tokenizer([], []), load_text("wikitext2", "validation")),
                                              3, 32, options.seed))

"""Datasets: the shipped WikiText-2 files, file inputs, tokenisation and calibration sampling."""

from __future__ import annotations

import json

import pytest
import torch

from ftc.data import PACKAGE_DATA, DatasetError, calibration_ids, ids_sha256, load_text, text_chunks, tokenize


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

"""Gemma 3 from GGUF: transformers' GGUF loader reads the config, our per-tensor reader
(`ftc.models.weights.GGUFSource`) gives back every tensor of the checkpoint it was written from."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from ftc.models.arch import layout_of
from ftc.models.weights import GGUFSource
from tests.support.gguf_files import write_gguf
from tests.support.tiny import tiny_model

gguf = pytest.importorskip("gguf")


def test_a_gemma3_gguf_reads_back_config_layout_and_every_tensor(tmp_path):
    model = tiny_model("gemma3")
    write_gguf(model, tmp_path / "g3.gguf", "gemma3")
    config = AutoConfig.from_pretrained(tmp_path, gguf_file="g3.gguf")
    assert layout_of(config) == layout_of(model.config)
    source = GGUFSource(tmp_path / "g3.gguf", config)
    expected = model.state_dict()
    assert sorted(source.names()) == sorted(expected)
    for name in source.names():
        torch.testing.assert_close(source.get(name).float(), expected[name].float(), rtol=0, atol=1e-6)


def test_gguf_parsed_once_gives_transformers_map_one_reader_per_file_and_restores_gguf(tmp_path):
    """The scoped caches change how often a GGUF is parsed and gguf's name map is built, not what they
    give: transformers' tensor-name mapping of a Gemma 3 model is the same inside the block, a file
    named as a string or a path is read once, by nested blocks too, and once more when written again,
    and `gguf` is left as it was when the outermost block ends."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    from ftc.models.weights import gguf_parsed_once

    model = tiny_model("gemma3", layers=2)
    write_gguf(model, tmp_path / "g3.gguf", "gemma3")
    processor = TENSOR_PROCESSORS["gemma3"](config=model.config.to_dict())
    original_map, original_reader = gguf.get_tensor_name_map, gguf.GGUFReader
    plain = get_gguf_hf_weights_map(model, processor)
    with gguf_parsed_once():
        first = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 2) is first  # once per (architecture, layers)
        assert get_gguf_hf_weights_map(model, processor) == plain
        reader = gguf.GGUFReader(tmp_path / "g3.gguf")
        with gguf_parsed_once():  # nested, as a block in another thread: the same caches
            assert gguf.GGUFReader(tmp_path / "g3.gguf") is reader
        assert gguf.GGUFReader(str(tmp_path / "g3.gguf")) is reader  # still there when the inner block ends
        assert [t.name for t in reader.tensors] == [t.name for t in original_reader(tmp_path / "g3.gguf").tensors]
        write_gguf(tiny_model("gemma3", layers=1), tmp_path / "new.gguf", "gemma3")
        (tmp_path / "new.gguf").replace(tmp_path / "g3.gguf")  # written again (atomically, as a download is)
        assert len(gguf.GGUFReader(tmp_path / "g3.gguf").tensors) < len(reader.tensors)  # and read again
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == (original_map, original_reader)
    assert original_map(gguf.MODEL_ARCH.GEMMA3, 2) is not original_map(gguf.MODEL_ARCH.GEMMA3, 2)


def test_a_gguf_compression_parses_its_file_once(tmp_path, monkeypatch):
    """`compress` takes a GGUF's config, tensors and tokenizer (built twice: for the calibration and for
    the artifact) from one parse of the file (`gguf_parsed_once`); each parse of a real vocabulary costs
    seconds. A tiny Llama with SmolLM2-135M's tokenizer, so the parse reads a real vocabulary."""
    from ftc.compression.compress import CompressOptions, compress
    from ftc.models.registry import resolve_model

    smol = resolve_model("smollm2-135m")
    model = tiny_model("gqa", vocab_size=49152, layers=2)
    write_gguf(model, tmp_path / "tiny.gguf", "llama", tokenizer_from=smol.path / smol.gguf_file)
    parsed, built = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *rest: parsed.append(path) or built(path, *rest))
    options = CompressOptions(model=str(tmp_path / "tiny.gguf"), ratio=0.5, allocation="uniform", calib_samples=2,
                              seq_len=64, dtype="float32")
    manifest = compress(options, tmp_path / "out", progress=False)
    assert len(parsed) == 1, parsed
    assert manifest["layers"] and (tmp_path / "out" / "tokenizer.json").is_file()

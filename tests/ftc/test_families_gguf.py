"""Gemma 3 from GGUF: transformers' GGUF loader reads the config, our per-tensor reader
(`ftc.models.weights.GGUFSource`) gives back every tensor of the checkpoint it was written from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from ftc.models.arch import layout_of
from ftc.models.weights import GGUFSource
from tests.support.tiny import tiny_model

gguf = pytest.importorskip("gguf")


def write_gemma3_gguf(model, path: Path) -> None:
    """A float32 GGUF of a Gemma 3 text model, tensor names and norm offsets as llama.cpp writes
    them (Gemma norms are stored as `1 + w`); names come from transformers' own GGUF name map."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    c = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    to_gguf = {hf: name for name, hf in get_gguf_hf_weights_map(
        model, TENSOR_PROCESSORS["gemma3"](config=c.to_dict())).items()}
    for name, tensor in model.state_dict().items():
        values = tensor.float().numpy()
        writer.add_tensor(to_gguf[name], (values + 1 if "norm.weight" in name else values).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gemma3_gguf_reads_back_config_layout_and_every_tensor(tmp_path):
    model = tiny_model("gemma3")
    write_gemma3_gguf(model, tmp_path / "g3.gguf")
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
    named as a string or a path is read once, by nested blocks too, and `gguf` is left as it was when
    the outermost block ends."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    from ftc.models.weights import gguf_parsed_once

    model = tiny_model("gemma3", layers=2)
    write_gemma3_gguf(model, tmp_path / "g3.gguf")
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
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == (original_map, original_reader)
    assert original_map(gguf.MODEL_ARCH.GEMMA3, 2) is not original_map(gguf.MODEL_ARCH.GEMMA3, 2)

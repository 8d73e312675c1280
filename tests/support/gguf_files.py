"""Small GGUF files written from tiny models, as llama.cpp's converter writes them, so the GGUF paths
(transformers' config and tokenizer, our tensor reader) run without the real checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_gguf(model, path: Path, architecture: str, tokenizer_from: Path | None = None) -> None:
    """A float32 GGUF of a `llama` or `gemma3` text model; tensor names come from transformers' own
    GGUF name map, Gemma's norms stored as `1 + w` as llama.cpp stores them. `tokenizer_from` copies
    another GGUF's `tokenizer.*` fields (its vocabulary must be the model's)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    c = model.config
    gemma = architecture == "gemma3"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    if gemma:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(c.sliding_window)
    else:
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if tokenizer_from is not None:
        for name, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if name.startswith("tokenizer."):
                writer.add_key_value(name, field.contents(), field.types[0],
                                     field.types[-1] if len(field.types) > 1 else None)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=c.to_dict())
    to_gguf = {hf: name for name, hf in get_gguf_hf_weights_map(model, processor).items()}
    for name, tensor in model.state_dict().items():
        values = tensor.float().numpy()
        writer.add_tensor(to_gguf[name], (values + 1 if gemma and "norm.weight" in name else values).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

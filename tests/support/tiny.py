"""Tiny random models of every supported attention layout, built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    GemmaConfig,
    GPTJConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(vocab_size=256, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)

LAYOUTS = {
    "mha": lambda: LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, **COMMON),
    "gqa": lambda: LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "mqa": lambda: MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, **COMMON),
    "wide_heads": lambda: LlamaConfig(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=32, **COMMON
    ),
    "qwen2_bias": lambda: Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "qwen3_qk_norm": lambda: Qwen3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **COMMON
    ),
    # Gemma style: head_dim larger than hidden / heads, one shared K/V head
    "gemma_mqa": lambda: GemmaConfig(
        hidden_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=32, **COMMON
    ),
    # Gemma 3: a sliding-window layer (window shorter than the test sequences, local rope base)
    # then a global one, q/k-norm, wide heads, MQA, scaled embeddings
    "gemma3": lambda: Gemma3TextConfig(
        hidden_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **COMMON
    ),
    # OLMo 2: q/k-norm over the whole projection, norms after attention and MLP
    "olmo2": lambda: Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **COMMON),
    # Phi-3: one fused qkv_proj (rows Q, K, V), GQA, rotary on part of each head, fused gate_up_proj
    "phi3": lambda: Phi3Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5,
        pad_token_id=0, eos_token_id=0, **COMMON
    ),
    # GPT-J: MHA, rotary on part of each head, parallel attention and MLP
    "gptj": lambda: GPTJConfig(
        vocab_size=256, n_embd=64, n_head=4, rotary_dim=8, n_layer=2, n_positions=256, n_inner=96,
        bos_token_id=0, eos_token_id=0,
    ),
}


def tiny_config(layout: str, vocab_size: int | None = None, layers: int | None = None, hidden: int | None = None):
    """The config of `LAYOUTS[layout]`, resized."""
    config = LAYOUTS[layout]()
    if vocab_size is not None:
        config.vocab_size = vocab_size
    if layers is not None:
        if getattr(config, "layer_types", None):  # the same pattern, repeated to the new depth
            config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(layers)]
        config.num_hidden_layers = layers
    if hidden is not None:  # wider model, same head count
        config.hidden_size = hidden
        config.head_dim = hidden // config.num_attention_heads
        config.intermediate_size = 2 * hidden
    return config


def tiny_model(layout: str, seed: int = 0, vocab_size: int | None = None, layers: int | None = None,
               hidden: int | None = None):
    """A random model; weights are perturbed so every bias is non-zero (Qwen2 biases start at 0)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(layout, vocab_size, layers, hidden)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                   patch_size=14)
"""A SigLIP tower of one layer: 2x2 patches of a 28-pixel image, 4 image tokens."""


def tiny_multimodal(vocab_size: int = 256, layers: int = 2, tied: bool = True, seed: int = 0):
    """A random Gemma 3 vision-language model (`Gemma3ForConditionalGeneration`) around the tiny
    `gemma3` text decoder; the image token is the last id, so text ids below it are text only.

    `tied` is the wrapper's own flag (the one transformers ties the head by); the text config keeps
    its default, so a reader that trusted the text config's flag would get the head wrong.
    """
    torch.manual_seed(seed)
    text = tiny_config("gemma3", vocab_size, layers).to_dict()
    config = Gemma3Config(text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4,
                          image_token_index=vocab_size - 1, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config).eval()

"""Load any resolved model for inference: a base checkpoint through transformers, a compressed
artifact through its own loader. It sits above both so that neither imports the other."""

from __future__ import annotations

import contextlib
import logging

import torch

from ftc.models.registry import ModelSource, load_tokenizer
from ftc.models.weights import gguf_parsed_once

from .artifact import load_artifact


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               runtime: str = "speed"):
    """`(model, tokenizer)` in eval mode. GGUF weights are dequantised to `dtype`; an artifact's
    groups run in the form `runtime` chooses (`load_artifact`)."""
    from transformers import AutoModelForCausalLM

    if source.kind == "artifact":
        model, tokenizer, _ = load_artifact(source.path, dtype, device, runtime)
        return model, tokenizer
    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with gguf_parsed_once() if source.gguf_file else contextlib.nullcontext():  # one parse for all three
        tokenizer = load_tokenizer(source)
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **extra)
    config = model.config
    if getattr(config, "quantization_config", None) is not None and source.kind == "gguf":
        del config.quantization_config  # dequantised: the weights are plain tensors now
    return model.to(device).eval(), tokenizer

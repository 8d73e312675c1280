"""Weight sources that hand out one tensor at a time, and a model skeleton with no weights.

The pipeline never holds a whole model: it builds the module tree on the meta device, then
materialises one decoder layer from the source onto the compute device, compresses it, writes
it out and releases it. Sources: safetensors (one file or an index with shards, memory-mapped),
GGUF (memory-mapped, dequantised per tensor), or a model already in memory. A multimodal checkpoint
(`ftc.models.arch.TEXT_PARTS`) is opened as its text decoder alone, a checkpoint of the text family.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from ftc.options import InputError

from .arch import TEXT_PARTS, TextPart
from .registry import ModelSource


class WeightSource(Protocol):
    config: object
    resident: bool
    """True when every weight already sits in host memory: there is no footprint left to bound."""
    text_part_of: str | None
    """The multimodal `model_type` whose text decoder this source presents (None: the whole checkpoint)."""

    def names(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


class SafetensorsSource:
    """`model.safetensors` or `model.safetensors.index.json` + shards in a Hugging Face folder."""

    resident = False
    text_part_of = None

    def __init__(self, folder: Path, config) -> None:
        from safetensors import safe_open

        self.config = config
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            with safe_open(folder / "model.safetensors", "pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json")
        self._files = {name: folder / shard for name, shard in weight_map.items()}
        self._safe_open = safe_open

    def names(self) -> list[str]:
        return list(self._files)

    def get(self, name: str) -> torch.Tensor:
        # opened per read: a long-lived map would keep every page it ever touched resident
        with self._safe_open(self._files[name], "pt") as f:
            return f.get_tensor(name)

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in set(self._files.values()))


class GGUFSource:
    """A GGUF file: tensors are dequantised one at a time from the memory-mapped file."""

    resident = False
    text_part_of = None

    def __init__(self, path: Path, config) -> None:
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        self.config = config
        self.path = path
        self._reader = GGUFReader(path)
        architecture = read_field(self._reader, "general.architecture")[0]
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
        with gguf_parsed_once():
            to_hf = get_gguf_hf_weights_map(skeleton(config), self._processor)
        self._tensors = {to_hf[t.name]: t for t in self._reader.tensors if t.name in to_hf}

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf import dequantize

        tensor = self._tensors[name]
        weights = self._processor.process(
            weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name, tensor_key_mapping={},
            parsed_parameters={},
        ).weights
        return torch.from_numpy(np.array(weights, dtype=np.float32))  # a writable copy off the map

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size


_GGUF_SHARED: dict = {"blocks": 0}
"""How many `gguf_parsed_once` blocks are open (nested, or in other threads) and what gguf had before
the first: only the last one out may put it back, or a block ending inside another would leave it
without its caches, or leave the caches installed for good."""
_GGUF_SHARED_LOCK = threading.RLock()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Each GGUF file parsed once, and gguf's tensor-name map built once per `(architecture, layers)`,
    while the block runs.

    Opening a GGUF for a compression reads it four times: transformers' config (`load_config`), our
    tensor reader (`GGUFSource`) and the tokenizer, twice (built for the calibration, dropped through
    the layers, built again for the artifact), each parsing every metadata field anew, the
    vocabulary's strings one numpy view at a time (6-8 s each for SmolLM2-135M's 49k tokens and
    merges). The reader is read-only once built, so one per file serves them all. transformers maps
    the tensor names (`get_gguf_hf_weights_map`, which its GGUF loading and `GGUFSource` call) by
    building gguf's `TensorNameMap` anew at every submodule, 397 times on SmolLM2-135M; the map is a
    function of its two arguments, so one per pair gives the same names. transformers imports both
    from the `gguf` module at each call, so they are replaced there while any such block is open (nested
    blocks and blocks in other threads share the caches). The readers live as long as the blocks (a
    `GGUFSource` keeps its own beyond them).
    """
    import gguf

    with _GGUF_SHARED_LOCK:
        if _GGUF_SHARED["blocks"] == 0:  # the first block in: caches for every block open beside or inside it
            built_map, built_reader = gguf.get_tensor_name_map, gguf.GGUFReader
            readers: dict[tuple, object] = {}

            def reader(path, mode: str = "r"):
                stat = os.stat(path)  # a file written again while a block is open is parsed again
                key = (os.path.realpath(path), mode, stat.st_mtime_ns, stat.st_size)
                with _GGUF_SHARED_LOCK:
                    if key not in readers:
                        readers[key] = built_reader(path, mode)
                    return readers[key]

            _GGUF_SHARED["saved"] = (built_map, built_reader)
            gguf.get_tensor_name_map, gguf.GGUFReader = functools.cache(built_map), reader
        _GGUF_SHARED["blocks"] += 1
    try:
        yield
    finally:
        with _GGUF_SHARED_LOCK:
            _GGUF_SHARED["blocks"] -= 1
            if _GGUF_SHARED["blocks"] == 0:  # the last block out puts gguf back and lets the readers go
                gguf.get_tensor_name_map, gguf.GGUFReader = _GGUF_SHARED.pop("saved")


class ModuleSource:
    """A model already in memory (benchmarks and tests reuse one loaded model for many runs)."""

    resident = True
    text_part_of = None

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def names(self) -> list[str]:
        return list(self._state)

    def get(self, name: str) -> torch.Tensor:
        return self._state[name].detach().clone()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state.values())


GGUF_MAGIC = b"GGUF"


def check_gguf(path: Path) -> None:
    """A file named .gguf must be one: anything else would end deep in transformers' reader."""
    try:
        with open(path, "rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror}") from None
    if magic != GGUF_MAGIC:
        raise InputError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); give a .gguf "
                         "file written by llama.cpp's converter, or a Hugging Face folder")


def load_config(source: ModelSource):
    from transformers import AutoConfig

    if source.kind == "gguf":
        check_gguf(source.path / source.gguf_file)
        config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    else:
        config = AutoConfig.from_pretrained(source.path)
    if getattr(config, "quantization_config", None) is not None and source.kind == "gguf":
        del config.quantization_config  # dequantised on read
    return config


class TextPartSource:
    """The text decoder of a multimodal checkpoint presented as a checkpoint of its own family: the
    text model's config (`text_model_config`) and its tensors under the text model's names. The
    vision tower and projector are never listed, so they are never read; the rest of the library
    sees a text-only model."""

    def __init__(self, wrapped: WeightSource) -> None:
        self.text_part_of = wrapped.config.model_type
        part = TEXT_PARTS[self.text_part_of]
        self.config = text_model_config(wrapped.config, part)
        self.resident = wrapped.resident
        self._wrapped = wrapped
        self._names: dict[str, str] = {}  # text model name -> checkpoint name
        for name in wrapped.names():
            own = part.text_name(name)
            if own in self._names:
                raise InputError(f"the checkpoint holds both {self._names[own]} and {name} for the text model's "
                                 f"{own}; save it again with transformers (`save_pretrained`)")
            if own is not None:
                self._names[own] = name
        if not self._names:
            raise InputError(f"the {self.text_part_of!r} checkpoint holds no tensor of its text decoder (names "
                             f"starting {', '.join(w for w, _ in part.prefixes)}); save it again with transformers")

    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str) -> torch.Tensor:
        return self._wrapped.get(self._names[name])

    @property
    def nbytes(self) -> int:
        return self._wrapped.nbytes


def text_model_config(config, part: TextPart):
    """The wrapper's `text_config` as the config of a model of its own (`part.architecture`).

    transformers ties a wrapper's output head to the embeddings by the wrapper's own
    `tie_word_embeddings`, so that flag replaces the text config's; the wrapper's dtype is kept
    where the text config names none.
    """
    text = copy.deepcopy(config.text_config)
    if text.model_type != part.model_type:
        raise InputError(f"text_config.model_type is {text.model_type!r}; a {config.model_type!r} checkpoint's "
                         f"text decoder must be {part.model_type!r}")
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    text.architectures = [part.architecture]
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    return text


def text_part(weights: WeightSource) -> WeightSource:
    """`weights` as its text decoder when it is a multimodal checkpoint (`TEXT_PARTS`), else unchanged."""
    return TextPartSource(weights) if getattr(weights.config, "model_type", None) in TEXT_PARTS else weights


def open_weights(source: ModelSource, config=None) -> WeightSource:
    """The checkpoint's weights, read one tensor at a time; a multimodal one opens as its text decoder."""
    config = config or load_config(source)
    if source.kind == "gguf":
        return text_part(GGUFSource(source.path / source.gguf_file, config))
    return text_part(SafetensorsSource(source.path, config))


def skeleton(config) -> nn.Module:
    """The model's module tree with parameters on the meta device (buffers such as rotary
    frequencies are real: they are computed, not loaded)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


UPCAST_ROWS = 1024
"""Output rows of a 16-bit weight converted to the compute dtype at a time (`BlockwiseLinear`)."""


class BlockwiseLinear(nn.Linear):
    """A Linear whose weight stays in its 16-bit checkpoint dtype between uses.

    The forward converts `UPCAST_ROWS` output rows at a time to the input's dtype, so the layer
    being compressed costs its checkpoint size in memory (half of float32), the largest transient
    is one block, and every product is the float32 product of the exactly converted weights. So does
    the backward pass to the input (the loss metric's, `ftc.compression.gradients`): autograd would
    otherwise keep every converted block for it, the whole layer in float32 beside its 16-bit self.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == x.dtype:
            return super().forward(x)
        return _BlockwiseProduct.apply(x, self.weight, self.bias)


def _upcast_rows(weight: torch.Tensor, dtype: torch.dtype) -> Iterator[tuple[slice, torch.Tensor]]:
    """`(rows, weight[rows] in dtype)`, `UPCAST_ROWS` output rows at a time: the one block loop of the
    blockwise product, forward and backward."""
    for start in range(0, weight.shape[0], UPCAST_ROWS):
        rows = slice(start, start + UPCAST_ROWS)
        yield rows, weight[rows].to(dtype)


def times_weight(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`y @ weight` for a Linear's `(out, in)` weight (its transposed product: the gradient of the
    input, or `W^T p` of an output-space vector), in `y`'s dtype. A weight in another dtype is
    converted `UPCAST_ROWS` rows at a time, as `BlockwiseLinear` converts it: a float32 copy of a
    16-bit head of a 7B shape is 0.5 GB, more than what a streamed compression holds besides."""
    if weight.dtype == y.dtype:
        return y @ weight
    out = y.new_zeros(*y.shape[:-1], weight.shape[1])
    for rows, block in _upcast_rows(weight, y.dtype):
        out += y[..., rows] @ block
    return out


def _blockwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight^T + bias` with `weight` converted to `x`'s dtype `UPCAST_ROWS` rows at a time."""
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for rows, block in _upcast_rows(weight, x.dtype):
        out[..., rows] = nn.functional.linear(x, block, None if bias is None else bias[rows].to(x.dtype))
    return out


class _BlockwiseProduct(torch.autograd.Function):
    """`_blockwise_linear` whose backward keeps the 16-bit weight, not its converted blocks, and gives
    the gradient of the input only (the weights are frozen: `materialize`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return _blockwise_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return times_weight(grad, weight), None, None


def materialize(model: nn.Module, module_name: str, weights: WeightSource, device, dtype: torch.dtype,
                include: Callable[[str], bool] | None = None) -> None:
    """Load every parameter of `module_name` from the source onto `device` (floats as `dtype`).

    Linear weights stored in a 16-bit dtype narrower than `dtype` stay in it, their modules
    computing block by block through `BlockwiseLinear`: exact conversion, half the memory.
    `include(name)`, with names relative to `module_name`, limits the load to some parameters (the
    rest stay where they are): a pipeline can load a layer's MLP only when it needs it.
    """
    module = model.get_submodule(module_name)
    available = set(weights.names())
    embed_name = embedding_weight_name(model)
    for name, param in list(module.named_parameters()):
        if include is not None and not include(name):
            continue
        full = f"{module_name}.{name}" if module_name else name
        if full not in available and full == "lm_head.weight":
            full = embed_name
        tensor = weights.get(full)
        owner, _, leaf = name.rpartition(".")
        target = module.get_submodule(owner) if owner else module
        keep = (isinstance(target, nn.Linear) and leaf == "weight" and tensor.itemsize == 2
                and tensor.is_floating_point() and torch.finfo(dtype).bits > 16)
        if keep:
            target.__class__ = BlockwiseLinear  # same state, blockwise forward
        if tensor.is_floating_point() and not keep:
            tensor = tensor.to(device, dtype)
        setattr(target, leaf, nn.Parameter(tensor.to(device), requires_grad=False))
        del param


def materialize_embedding_rows(model: nn.Module, weights: WeightSource, token_ids: torch.Tensor, device) -> str:
    """Load only the input-embedding rows that `token_ids` use, in float32; returns the module name.

    The rest of the matrix is allocated but never written or read, so it never becomes resident:
    calibration needs a few thousand rows of a vocabulary that may hold hundreds of thousands.
    """
    name = embedding_weight_name(model)
    stored = weights.get(name)
    rows = torch.unique(token_ids)
    table = torch.empty(stored.shape, dtype=torch.float32, device=device)
    table[rows.to(device)] = stored[rows].to(device, torch.float32)
    del stored
    module_name = name.rpartition(".")[0]
    model.get_submodule(module_name).weight = nn.Parameter(table, requires_grad=False)
    return module_name


def release(model: nn.Module, module_name: str) -> None:
    """Drop the weights of `module_name` back to the meta device."""
    model.get_submodule(module_name).to("meta")


def embedding_weight_name(model: nn.Module) -> str:
    embed = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is embed:
            return f"{name}.weight"
    raise ValueError("model has no input embedding")

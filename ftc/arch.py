"""Where attention lives in each supported Hugging Face architecture family.

Everything model-specific sits here: the rest of the library sees decoder layers, four projection
names and the head geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .options import InputError

LLAMA_STYLE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
FAMILIES: dict[str, tuple[str, tuple[str, str, str, str]]] = {
    "llama": ("model.layers", LLAMA_STYLE),
    "mistral": ("model.layers", LLAMA_STYLE),
    "qwen2": ("model.layers", LLAMA_STYLE),
    "qwen3": ("model.layers", LLAMA_STYLE),
    "gemma": ("model.layers", LLAMA_STYLE),
    "gemma2": ("model.layers", LLAMA_STYLE),
    "gemma3_text": ("model.layers", LLAMA_STYLE),
    "olmo2": ("model.layers", LLAMA_STYLE),
    # one fused `qkv_proj` whose rows are the Q, K and V blocks: all three name it
    "phi3": ("model.layers", ("self_attn.qkv_proj",) * 3 + ("self_attn.o_proj",)),
    "gptj": ("transformer.h", ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj")),
}


@dataclass(frozen=True)
class TextPart:
    """Where a multimodal wrapper keeps its text decoder: the family and class of that decoder on its
    own, and the checkpoint name prefixes of its weights with the prefix each has in that class."""

    model_type: str
    architecture: str
    prefixes: tuple[tuple[str, str], ...]

    def text_name(self, name: str) -> str | None:
        """The text model's name for a checkpoint tensor, or None for one outside the text decoder
        (vision tower, multimodal projector)."""
        for wrapped, own in self.prefixes:
            if name.startswith(wrapped):
                return own + name[len(wrapped):]
        return None


TEXT_PARTS: dict[str, TextPart] = {
    # saved checkpoints say `language_model.model.*` (and `language_model.lm_head` when untied);
    # the module tree, and checkpoints saved from it, say `model.language_model.*` and `lm_head`
    "gemma3": TextPart("gemma3_text", "Gemma3ForCausalLM", (
        ("language_model.model.", "model."), ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
    )),
}
"""Multimodal wrappers whose text decoder is compressed on its own: `ftc.weights.open_weights`
presents it as a checkpoint of `model_type`, so nothing downstream sees the wrapper."""


class UnsupportedModel(InputError):
    pass


@dataclass(frozen=True)
class AttentionLayout:
    """Head geometry of one model and the names of its projections inside a decoder layer."""

    model_type: str
    layers_path: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    q: str
    k: str
    v: str
    o: str

    @property
    def slices(self) -> int:
        """`S = Hq + 2*Hkv` (§2)."""
        return self.heads + 2 * self.kv_heads

    @property
    def projections(self) -> dict[str, str]:
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o}

    @property
    def fused_qkv(self) -> str | None:
        """The one module holding Q, K and V as row blocks (Phi-3's `qkv_proj`), if they are fused."""
        return self.q if self.q == self.k == self.v else None

    @property
    def qkv_rows(self) -> dict[str, tuple[int, int]]:
        """Rows of Q, K and V in a fused projection's `(out, in)` weight: Q heads, K heads, V heads."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}

    @property
    def qkv_params(self) -> int:
        return self.hidden * self.head_dim * self.slices

    @property
    def o_params(self) -> int:
        return self.heads * self.head_dim * self.hidden


def layout_of(config) -> AttentionLayout:
    """Read the attention geometry from a transformers config, or name the supported families."""
    model_type = getattr(config, "model_type", None)
    if model_type in TEXT_PARTS:  # its module tree nests the decoder beside a vision tower
        raise UnsupportedModel(
            f"{model_type!r} is a multimodal wrapper; read it through ftc.weights.open_weights, which presents "
            f"its text decoder as a {TEXT_PARTS[model_type].model_type!r} checkpoint"
        )
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}; "
            f"and the text decoder of: {', '.join(sorted(TEXT_PARTS))}"
        )
    layers_path, (q, k, v, o) = FAMILIES[model_type]
    hidden = config.hidden_size if hasattr(config, "hidden_size") else config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return AttentionLayout(model_type, layers_path, hidden, heads, kv_heads, head_dim, q, k, v, o)


def layer_types(config, count: int) -> tuple[str, ...]:
    """The attention type of each decoder layer (`config.layer_types`: Gemma 2/3 interleave
    sliding-window and global layers, each type with its own mask and rotary embedding), or one
    type for every layer of a family whose layers all take the same arguments."""
    types = getattr(config, "layer_types", None)
    return tuple(types[:count]) if types else ("all",) * count


def decoder_layers(model: nn.Module, layout: AttentionLayout) -> nn.ModuleList:
    return model.get_submodule(layout.layers_path)


def projection_weights(layer: nn.Module, layout: AttentionLayout) -> tuple[dict, dict]:
    """`(out, in)` weight and bias of each projection (keyed q/k/v/o); a fused Q/K/V module is
    split into its row blocks, so the methods see the same three matrices in every family."""
    weights, biases = {}, {}
    for proj, name in layout.projections.items():
        module = get_module(layer, name)
        weights[proj], biases[proj] = module.weight, module.bias
        if proj != "o" and name == layout.fused_qkv:
            if module.bias is not None:  # Phi-3's has none; a bias would need its own split and export
                raise UnsupportedModel(f"{name} is a fused Q/K/V projection with a bias; not supported")
            start, stop = layout.qkv_rows[proj]
            weights[proj] = module.weight[start:stop]
    return weights, biases


def get_module(layer: nn.Module, name: str) -> nn.Module:
    return layer.get_submodule(name)


def set_module(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, leaf, module)

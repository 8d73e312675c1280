"""Where attention and the MLP live in each supported Hugging Face architecture family.

Everything model-specific sits here: the rest of the library sees decoder layers, the names of
the seven linear projections (q, k, v, o; gate, up, down) and the head geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ftc.options import InputError

LLAMA_STYLE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
GATED_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FAMILIES: dict[str, tuple[str, tuple[str, str, str, str], tuple[str | None, str, str]]] = {
    "llama": ("model.layers", LLAMA_STYLE, GATED_MLP),
    "mistral": ("model.layers", LLAMA_STYLE, GATED_MLP),
    "qwen2": ("model.layers", LLAMA_STYLE, GATED_MLP),
    "qwen3": ("model.layers", LLAMA_STYLE, GATED_MLP),
    "gemma": ("model.layers", LLAMA_STYLE, GATED_MLP),
    "gemma2": ("model.layers", LLAMA_STYLE, GATED_MLP),
    "gemma3_text": ("model.layers", LLAMA_STYLE, GATED_MLP),
    "olmo2": ("model.layers", LLAMA_STYLE, GATED_MLP),
    # one fused `qkv_proj` whose rows are the Q, K and V blocks: all three name it; likewise
    # `gate_up_proj`, rows gate then up
    "phi3": ("model.layers", ("self_attn.qkv_proj",) * 3 + ("self_attn.o_proj",),
             ("mlp.gate_up_proj", "mlp.gate_up_proj", "mlp.down_proj")),
    # a two-matrix MLP: no gate
    "gptj": ("transformer.h", ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"),
             (None, "mlp.fc_in", "mlp.fc_out")),
}
"""Per `model_type`: the decoder layers' path, the attention projections (q, k, v, o) and the MLP
projections (gate, up, down; gate None for a two-matrix MLP) inside a decoder layer."""




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
"""Multimodal wrappers whose text decoder is compressed on its own: `ftc.models.weights.open_weights`
presents it as a checkpoint of `model_type`, so nothing downstream sees the wrapper."""


class UnsupportedModel(InputError):
    pass


@dataclass(frozen=True)
class AttentionLayout:
    """Head and MLP geometry of one model and the names of its projections inside a decoder layer."""

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
    intermediate: int = 0
    gate: str | None = None
    up: str = ""
    down: str = ""

    @property
    def slices(self) -> int:
        """`S = Hq + 2*Hkv` (§2)."""
        return self.heads + 2 * self.kv_heads

    @property
    def projections(self) -> dict[str, str]:
        """The attention projections, keyed q/k/v/o."""
        return {"q": self.q, "k": self.k, "v": self.v, "o": self.o}

    @property
    def mlp_projections(self) -> dict[str, str]:
        """The MLP projections, keyed gate/up/down (no gate in a two-matrix MLP)."""
        names = {"gate": self.gate, "up": self.up, "down": self.down}
        return {key: name for key, name in names.items() if name}

    @property
    def all_projections(self) -> dict[str, str]:
        """The seven linear projections of a decoder layer (six without a gate)."""
        return {**self.projections, **self.mlp_projections}

    def scoped(self, scope: str) -> dict[str, str]:
        """The projections a `scope` compresses: attention's, or every linear one of the layer."""
        return self.projections if scope == "attention" else self.all_projections

    @property
    def fused_gate_up(self) -> str | None:
        """The one module holding gate and up as row blocks (Phi-3's `gate_up_proj`), if fused."""
        return self.up if self.gate == self.up else None

    @property
    def mlp_in(self) -> tuple[str, ...]:
        """The MLP projections that read the MLP input: gate and up, or up alone."""
        return ("gate", "up") if self.gate else ("up",)

    @property
    def mlp_in_params(self) -> int:
        return self.hidden * self.intermediate * len(self.mlp_in)

    @property
    def down_params(self) -> int:
        return self.intermediate * self.hidden

    def part_params(self, scope: str) -> dict[str, int]:
        """Parameters of each budgeted part of one decoder layer (§1, §17): the Q/K/V tensor and
        `W_O`, and with scope `model` the gate/up tensor and `W_down`."""
        parts = {"qkv": self.qkv_params, "o": self.o_params}
        if scope == "model":
            parts.update(gateup=self.mlp_in_params, down=self.down_params)
        return parts

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
    def gate_up_rows(self) -> dict[str, tuple[int, int]]:
        """Rows of gate and up in a fused projection's `(out, in)` weight: gate, then up."""
        return {"gate": (0, self.intermediate), "up": (self.intermediate, 2 * self.intermediate)}

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
            f"{model_type!r} is a multimodal wrapper; read it through ftc.models.weights.open_weights, which presents "
            f"its text decoder as a {TEXT_PARTS[model_type].model_type!r} checkpoint"
        )
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}; "
            f"and the text decoder of: {', '.join(sorted(TEXT_PARTS))}"
        )
    layers_path, (q, k, v, o), (gate, up, down) = FAMILIES[model_type]
    hidden = config.hidden_size if hasattr(config, "hidden_size") else config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return AttentionLayout(model_type, layers_path, hidden, heads, kv_heads, head_dim, q, k, v, o,
                           intermediate, gate, up, down)


def layer_types(config, count: int) -> tuple[str, ...]:
    """The attention type of each decoder layer (`config.layer_types`: Gemma 2/3 interleave
    sliding-window and global layers, each type with its own mask and rotary embedding), or one
    type for every layer of a family whose layers all take the same arguments."""
    types = getattr(config, "layer_types", None)
    return tuple(types[:count]) if types else ("all",) * count


def decoder_layers(model: nn.Module, layout: AttentionLayout) -> nn.ModuleList:
    return model.get_submodule(layout.layers_path)


def projection_weights(layer: nn.Module, layout: AttentionLayout, names: dict[str, str] | None = None
                       ) -> tuple[dict, dict]:
    """`(out, in)` weight and bias of each projection of `names` (default: attention's, keyed
    q/k/v/o); a fused Q/K/V or gate/up module is split into its row blocks, so the methods see the
    same matrices in every family."""
    weights, biases = {}, {}
    fused = {layout.fused_qkv: layout.qkv_rows, layout.fused_gate_up: layout.gate_up_rows}
    for proj, name in (layout.projections if names is None else names).items():
        module = get_module(layer, name)
        weights[proj], biases[proj] = module.weight, module.bias
        rows = fused.get(name) if name else None
        if rows is not None and proj in rows:
            if module.bias is not None:  # Phi-3's have none; a bias would need its own split and export
                raise UnsupportedModel(f"{name} is a fused projection with a bias; not supported")
            start, stop = rows[proj]
            weights[proj] = module.weight[start:stop]
    return weights, biases


def get_module(layer: nn.Module, name: str) -> nn.Module:
    return layer.get_submodule(name)


def set_module(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(layer.get_submodule(parent) if parent else layer, leaf, module)

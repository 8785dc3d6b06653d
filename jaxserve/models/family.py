"""What a model module provides, and the parts most families share.

A family (one module under jaxserve/models/) owns, in one place:
  * config reading: `read_config(hf_config, architecture) -> ModelArch` (family facts in
    `arch.options`, a `DecoderOptions` subclass; `arch_from_config` reads the common fields);
  * its weight layout: `weight_shapes(arch)`, every tensor stacked on a layer axis
    (``layers.q_proj.kernel [L, H, Hq*D]``, kernels ``[in, out]``; loader/weights.py);
  * its checkpoint mapping: `layer_tensors` / `global_tensors` (our name → (HF safetensors
    name, GGUF name)) and `from_gguf` (llama.cpp's q/k permutation, Gemma's norm + 1);
  * its parameter tree (`params_from_weights`) and partition specs for tensor
    parallelism (`partition_rules`, Megatron-style: see `param_spec`);
  * its forward pass: `build(...)` returns the linen module, `constants(arch)` its
    per-step constant arrays (rotary tables, per-layer windows).
The runner, the loaders, the dummy loader and parallel/ only ever talk to a family
through this interface (registry.family_for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.mesh import MODEL_AXIS
from jaxserve.models.arch import DecoderOptions, ModelArch
from jaxserve.quantization.awq_gptq import LEAVES as AWQ_GPTQ_LEAVES
from jaxserve.quantization.gguf_packed import BYTES_PER_BLOCK, PACKED_FORMATS, WEIGHTS_PER_BLOCK

# Partition rule kinds (Megatron-style on the `model` axis):
COLUMN = "column"         # [L, in, out] kernels split by output columns, biases with them
ROW = "row"               # [L, in, out] kernels split by input rows; bias after the all-reduce
VOCAB_ROWS = "vocab_rows"  # embedding [V, H]: on vocab if it divides, else hidden
VOCAB_COLS = "vocab_cols"  # lm_head [H, V]: the same, transposed
REPLICATED = "replicated"


@dataclass(frozen=True)
class ArchitectureInfo:
    """One row of the README's supported-architecture table (checked by a test)."""
    examples: str
    sliding_window: str = "no"
    soft_cap: str = "no"
    moe: str = "no"
    expert_parallel: str = "no"


class ModelFamily:
    name: str = ""
    architectures: dict[str, ArchitectureInfo] = {}   # HF architectures[0] -> README row
    model_types: dict[str, str] = {}                   # HF model_type -> architecture
    gguf_architectures: dict[str, tuple[str, str]] = {}  # GGUF arch -> (HF arch, config class)
    # our per-layer name -> (HF suffix after "model.layers.N.", GGUF suffix after "blk.N.");
    # a GGUF suffix may be a tuple of alternatives (llama.cpp's layouts of one tensor)
    layer_tensors: dict[str, tuple[str, str]] = {}
    # our whole-model name -> (HF name, GGUF name)
    global_tensors: dict[str, tuple[str, str]] = {
        "embed_tokens": ("model.embed_tokens.weight", "token_embd.weight"),
        "norm": ("model.norm.weight", "output_norm.weight"),
        "lm_head": ("lm_head.weight", "output.weight"),
    }
    # module name (second path element under "layers", else the first) -> rule kind
    partition_rules: dict[str, str] = {}
    # tensors holding KV heads on their last axis (replicated when tp > num_kv_heads)
    kv_head_weights: tuple[str, ...] = ("layers.k_proj.kernel", "layers.v_proj.kernel",
                                        "layers.k_proj.bias", "layers.v_proj.bias")
    norm_center: float = 1.0   # random (dummy) norm weights are this + noise

    # -- config ------------------------------------------------------------------------------
    def read_config(self, hf_config: Any, architecture: str) -> ModelArch:
        """architecture: which of `architectures` the config is (the registry resolved it)."""
        raise NotImplementedError

    def reads_gguf(self, gguf_arch: str, value: Any) -> bool:
        """Whether this family reads a GGUF file of gguf_arch (one of `gguf_architectures`)
        with this metadata (value(key, default)); dense families do not read a file with
        experts (llama.cpp writes Mixtral as "llama" plus expert_count)."""
        return not value("expert_count", 0)

    def gguf_config(self, gguf_arch: str, value: Any) -> dict[str, Any]:
        """Config kwargs beyond the common ones a GGUF file of this family carries.
        value(key, default): one metadata value of the file."""
        return {}

    # -- weights -----------------------------------------------------------------------------
    def weight_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def from_gguf(self, name: str, weight: np.ndarray, arch: ModelArch,
                  gguf_arch: str) -> np.ndarray:
        """A GGUF tensor (HF orientation) → what the HF checkpoint holds (undo converter edits)."""
        return weight

    def params_from_weights(self, weights: dict[str, Any], arch: ModelArch) -> dict[str, Any]:
        """Map the flat stacked layout (``layers.q_proj.kernel``) onto the linen tree."""
        layers: dict[str, dict[str, Any]] = {}
        params: dict[str, Any] = {"layers": layers}
        expected = self.weight_shapes(arch)
        present = set()
        for name, value in weights.items():
            # A GGUF-packed tensor ("layers.q_proj.q4_1", "embed_tokens.q8_0") stands in for
            # the float one ("layers.q_proj.kernel", "embed_tokens"); quantization/gguf_packed.py;
            # so do an AWQ / GPTQ projection's "layers.q_proj.qweight" / scales / zeros / g_idx
            base, _, fmt = name.rpartition(".")
            if fmt in PACKED_FORMATS or (fmt in AWQ_GPTQ_LEAVES and base.startswith("layers.")):
                float_name = base + ".kernel" if base.startswith("layers.") else base
                if float_name not in expected:
                    raise ValueError(f"unexpected packed weight {name!r} for {arch.architecture}")
                present.add(float_name)
                if base.startswith("layers."):
                    layers.setdefault(base.split(".")[1], {})[fmt] = value
                else:
                    params.setdefault(base, {})[fmt] = value
                continue
            present.add(name)
            if name not in expected:
                raise ValueError(f"unexpected weight {name!r} for {arch.architecture}")
            if name.startswith("layers."):
                parts = name.split(".")[1:]
                module, leaf = parts[0], (parts[1] if len(parts) > 1 else "weight")
                layers.setdefault(module, {})[leaf] = value
            else:
                params.setdefault(name, {})[{"embed_tokens": "embedding",
                                             "lm_head": "kernel"}.get(name, "weight")] = value
        missing = sorted(set(expected) - present)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing}")
        return {"params": params}

    # -- tensor parallelism ------------------------------------------------------------------
    def param_spec(self, path: tuple[str, ...], shape: tuple[int, ...], tp: int) -> P:
        """PartitionSpec of one parameter, by its path in the linen tree (without 'params')."""
        if tp == 1:
            return P()
        module = path[1] if path[0] == "layers" and len(path) == 3 else path[0]
        kind = self.partition_rules.get(module)
        leaf = path[-1]
        if leaf in PACKED_FORMATS:
            return _packed_spec(kind, leaf, shape, tp, "/".join(path))
        if leaf in AWQ_GPTQ_LEAVES and path[0] == "layers":
            return _awq_gptq_spec(kind, leaf, shape, tp, "/".join(path))
        if leaf == "scale" and kind in (VOCAB_ROWS, VOCAB_COLS):   # int8 lm_head [V] / [H/g, V]
            return P(*([None] * (len(shape) - 1)), MODEL_AXIS) if shape[-1] % tp == 0 else P()
        # int8 scales (quantization/int8.py): [L, out] per column, [L, in/g, out] group-wise
        grouped = leaf == "scale" and len(shape) == 3
        if kind == COLUMN:
            if leaf == "kernel" or grouped:
                return P(None, None, MODEL_AXIS)
            return P(None, MODEL_AXIS)
        if kind == ROW:
            if grouped:     # the row split cuts `in`, so it cuts the groups with it
                if shape[1] % tp:
                    raise ValueError(f"{'/'.join(path)}: {shape[1]} int8 groups do not split "
                                     f"over tp={tp}; choose another tensor_parallel_size")
                return P(None, MODEL_AXIS, None)
            return P(None, MODEL_AXIS, None) if leaf == "kernel" else P()
        if kind in (VOCAB_ROWS, VOCAB_COLS):
            return _vocab_or_hidden(shape, 0 if kind == VOCAB_ROWS else 1, tp)
        if kind == REPLICATED or (kind is None and leaf == "weight"):
            return P()                      # norms: [H], [L, H], q/k norms [L, D]
        raise ValueError(f"no partition spec for parameter {'/'.join(path)} {shape}; add one "
                         f"to partition_rules of {type(self).__module__}")

    def param_spec_for(self, arch: ModelArch) -> Callable[[tuple[str, ...], tuple[int, ...], int], P]:
        """The spec function for one (sharded) arch: `param_spec` unless the family's specs
        depend on more than tp (mixture of experts: expert vs tensor parallel)."""
        return self.param_spec

    def arch_for_mesh(self, arch: ModelArch, mesh: Any, expert_parallel: bool) -> ModelArch:
        """The arch a model sharded on `mesh` (None: one device) runs; dense families ignore
        expert_parallel, as vLLM does."""
        return arch

    # -- forward -----------------------------------------------------------------------------
    def build(self, arch: ModelArch, backend: Any, num_blocks: int, block_size: int,
              dtype: Any, plan: Any) -> Any:
        """The linen module (models/decoder.py's CausalLM contract), built with its static
        execution plan (models/execution_plan.py): apply(params, token_ids, positions, meta,
        k_cache, v_cache, constants) -> (hidden [T, H], k_cache, v_cache); method
        `logits(hidden rows)` -> [N, V] f32; `forward_logits(..., logits_indices, constants)`
        -> (logits [S, V], caches). params["layers"] is stacked [L, ...], or with the plan's
        LayerLoop.PER_LAYER split per layer (decoder.per_layer_weights)."""
        raise NotImplementedError

    def constants(self, arch: ModelArch) -> dict[str, np.ndarray]:
        raise NotImplementedError


def _packed_spec(kind: str | None, fmt: str, shape: tuple[int, ...], tp: int, name: str) -> P:
    """A packed [.., rows = out, blocks * bytes] tensor: column-split layers and the vocab
    split rows; row-split layers split whole blocks of the input axis."""
    rows = [None] * (len(shape) - 2)
    if kind == COLUMN:
        return P(*rows, MODEL_AXIS, None)
    if kind in (VOCAB_ROWS, VOCAB_COLS):
        return P(MODEL_AXIS, None) if shape[0] % tp == 0 else P()
    if kind == ROW:
        blocks = shape[-1] // BYTES_PER_BLOCK[fmt]
        if blocks % tp:
            raise ValueError(f"{name}: {blocks} blocks of {WEIGHTS_PER_BLOCK[fmt]} input features do "
                             f"not split over tensor_parallel_size={tp}")
        return P(*rows, None, MODEL_AXIS)
    raise ValueError(f"no partition spec for packed parameter {name} {shape}")


def _awq_gptq_spec(kind: str | None, leaf: str, shape: tuple[int, ...], tp: int,
                   name: str) -> P:
    """An AWQ / GPTQ projection (quantization/awq_gptq.py; stacked: qweight [L, in/p, out],
    scales / zeros [L, G, out], g_idx [L, in]). Column-split layers split `out` (g_idx, over
    `in`, replicated); row-split layers split the packed words of `in` and g_idx with them,
    and keep the small group tables whole, so any group assignment (act-order's included)
    finds its group on every device."""
    if kind == COLUMN:
        return P() if leaf == "g_idx" else P(None, None, MODEL_AXIS)
    if kind == ROW:
        if leaf in ("scales", "zeros"):
            return P()
        if shape[1] % tp:
            raise ValueError(f"{name}: {shape[1]} rows of packed input features do not "
                             f"split over tensor_parallel_size={tp}")
        return P(None, MODEL_AXIS) if leaf == "g_idx" else P(None, MODEL_AXIS, None)
    raise ValueError(f"no partition spec for AWQ/GPTQ parameter {name} {shape}")


def _vocab_or_hidden(shape: tuple[int, ...], vocab_axis: int, tp: int) -> P:
    """Split a [V, H] / [H, V] matrix on vocab if it divides, else on hidden, else replicate."""
    spec: list[Any] = [None, None]
    if shape[vocab_axis] % tp == 0:
        spec[vocab_axis] = MODEL_AXIS
    elif shape[1 - vocab_axis] % tp == 0:
        spec[1 - vocab_axis] = MODEL_AXIS
    return P(*spec)


MEGATRON_RULES = {"q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "gate_proj": COLUMN,
                  "up_proj": COLUMN, "o_proj": ROW, "down_proj": ROW,
                  "embed_tokens": VOCAB_ROWS, "lm_head": VOCAB_COLS}


def stacked_layer_shapes(arch: ModelArch, per_layer: dict[str, tuple[int, ...]]
                         ) -> dict[str, tuple[int, ...]]:
    """``{"q_proj.kernel": (H, Hq*D)}`` → ``{"layers.q_proj.kernel": (L, H, Hq*D)}``."""
    return {f"layers.{name}": (arch.num_layers, *shape) for name, shape in per_layer.items()}


def hf_layer_types(config: Any, window: int | None,
                   sliding_by_default: Callable[[int], bool] = lambda i: False
                   ) -> tuple[int, ...]:
    """Per-layer windows from HF's `layer_types` ("sliding_attention" / "full_attention");
    configs from transformers < 5 may lack them: then layer i slides if
    sliding_by_default(i) (the rule that version's modeling code applied)."""
    layers = config.num_hidden_layers
    if not window:
        return (0,) * layers
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return tuple(int(window) if sliding_by_default(i) else 0 for i in range(layers))


# -- what the decoder families share ---------------------------------------------------------

def arch_from_config(config: Any, architecture: str, options: DecoderOptions,
                     layer_windows: tuple[int, ...], *, intermediate_size: int | None = None,
                     head_dim: int | None = None, max_position_embeddings: int = 2048,
                     tie_word_embeddings: bool = False) -> ModelArch:
    """The `ModelArch` of an HF decoder config (Llama's field names, which every family
    here uses); the keyword arguments are the family's defaults for fields a config may
    omit, and `intermediate_size` / `head_dim` override the config's."""
    num_heads = config.num_attention_heads
    return ModelArch(
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size if intermediate_size is None
        else intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim or getattr(config, "head_dim", None)
        or config.hidden_size // num_heads,
        max_position_embeddings=int(getattr(config, "max_position_embeddings",
                                            max_position_embeddings)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", tie_word_embeddings)),
        layer_windows=layer_windows,
        options=options)


def attention_tensors() -> dict[str, tuple[str, str]]:
    """Attention projections (kernels and biases) and q/k norms: our per-layer name ->
    (HF suffix under ``self_attn.``, GGUF suffix), the names every family here shares."""
    names = {"q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),
             "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight")}
    for p, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        names[f"{p}_proj.kernel"] = (f"self_attn.{p}_proj.weight", f"{g}.weight")
        names[f"{p}_proj.bias"] = (f"self_attn.{p}_proj.bias", f"{g}.bias")
    return names


PRE_NORM_TENSORS = {     # Llama's two norms per layer
    "input_layernorm": ("input_layernorm.weight", "attn_norm.weight"),
    "post_attention_layernorm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
}
GATED_MLP_TENSORS = {
    "gate_proj.kernel": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "up_proj.kernel": ("mlp.up_proj.weight", "ffn_up.weight"),
    "down_proj.kernel": ("mlp.down_proj.weight", "ffn_down.weight"),
}


def attention_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """One layer's q/k/v/o kernels ([in, out])."""
    H = arch.hidden_size
    return {"q_proj.kernel": (H, arch.q_size), "k_proj.kernel": (H, arch.kv_size),
            "v_proj.kernel": (H, arch.kv_size), "o_proj.kernel": (arch.q_size, H)}


def attention_extra_shapes(arch: ModelArch, *, qkv_bias: bool = False, o_bias: bool = False,
                           qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    """One layer's optional attention tensors: q/k/v biases, the o bias, q/k norms."""
    shapes: dict[str, tuple[int, ...]] = {}
    if qkv_bias:
        shapes |= {"q_proj.bias": (arch.q_size,), "k_proj.bias": (arch.kv_size,),
                   "v_proj.bias": (arch.kv_size,)}
    if o_bias:
        shapes["o_proj.bias"] = (arch.hidden_size,)
    if qk_norm:
        shapes |= {"q_norm": (arch.head_dim,), "k_norm": (arch.head_dim,)}
    return shapes


def gated_mlp_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    H, I = arch.hidden_size, arch.intermediate_size
    return {"gate_proj.kernel": (H, I), "up_proj.kernel": (H, I), "down_proj.kernel": (I, H)}


def decoder_weight_shapes(arch: ModelArch, per_layer: dict[str, tuple[int, ...]]
                          ) -> dict[str, tuple[int, ...]]:
    """Embedding, final norm, the stacked layers, lm_head (unless tied). The order fixes
    which random values `--load-format dummy` gives each tensor (loader/dummy.py)."""
    H = arch.hidden_size
    shapes = {"embed_tokens": (arch.vocab_size, H), "norm": (H,),
              **stacked_layer_shapes(arch, per_layer)}
    if not arch.tie_word_embeddings:
        shapes["lm_head"] = (H, arch.vocab_size)
    return shapes

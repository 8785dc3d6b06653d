"""Gemma 2 and Gemma 3 (text): Gemma2ForCausalLM, Gemma3ForCausalLM.

What sets them apart from Llama: RMSNorm scales by (1 + w) (weights stored around 0),
four norms per layer (the attention and MLP outputs are normed before the residual
add), embeddings scaled by sqrt(hidden), a gelu-tanh gated MLP, attention scaled by
query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, and interleaved local
(sliding-window) and global layers from `layer_types`. Gemma 2 soft-caps attention
logits and final logits (cap * tanh(x / cap)); Gemma 3 norms q and k per head and gives
local layers their own rope base (rope_local_base_freq) while global layers keep the
scaled global rope.

GGUF: llama.cpp's converter adds 1 to every Gemma norm weight (it stores 1 + w);
`from_gguf` subtracts it back. It does not store query_pre_attn_scalar, the local rope
base or Gemma 3's window pattern; `gguf_config` uses llama.cpp's own rules for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import numpy as np

from jaxserve.models.arch import DecoderOptions, ModelArch
from jaxserve.models.decoder import (
    CausalLM,
    DecoderLayer,
    attention_config,
    layer_constants,
    layer_inputs,
)
from jaxserve.models.family import (
    GATED_MLP_TENSORS,
    MEGATRON_RULES,
    ArchitectureInfo,
    ModelFamily,
    arch_from_config,
    attention_extra_shapes,
    attention_shapes,
    attention_tensors,
    decoder_weight_shapes,
    gated_mlp_shapes,
    hf_layer_types,
)
from jaxserve.models.layers import (
    ACTIVATIONS,
    PagedCache,
    RMSNorm,
    gated_mlp,
    paged_self_attention,
)
from jaxserve.models.rope import Rope, hf_rope_parameters

GEMMA3_LOCAL_ROPE_BASE = 10000.0   # Gemma 3's rope_local_base_freq (llama.cpp hard-codes it)


@dataclass(frozen=True, kw_only=True)
class GemmaOptions(DecoderOptions):
    activation: str
    sm_scale: float                 # query_pre_attn_scalar ** -0.5
    attn_logit_soft_cap: float      # 0: off
    qk_norm: bool                   # Gemma 3
    attention_bias: bool
    ropes: tuple[Rope, ...]         # Gemma 2: (global,); Gemma 3: (local, global)
    layer_rope: tuple[int, ...]     # per layer: index into ropes
    norm_offset: float = 1.0


class GemmaDecoderLayer(DecoderLayer):

    @nn.compact
    def __call__(self, carry, xs, cos, sin, meta, in_place=None):
        x, k_cache, v_cache = carry
        a, o, dt = self.arch, self.arch.options, self.dtype
        layer_idx, window, cos, sin = layer_inputs(a, xs, cos, sin)
        attn = attention_config(a, qkv_bias=o.attention_bias, o_bias=o.attention_bias,
                                qk_norm=o.qk_norm, norm_offset=o.norm_offset,
                                sm_scale=o.sm_scale, logits_soft_cap=o.attn_logit_soft_cap)

        def norm(name: str) -> RMSNorm:
            return RMSNorm(o.rms_norm_eps, dt, o.norm_offset, name=name)

        weights = in_place.at(layer_idx) if in_place is not None else None
        out, k_cache, v_cache = paged_self_attention(
            norm("input_layernorm")(x), attn, self.cache, k_cache, v_cache, layer_idx,
            window, cos, sin, meta, dt, weights)
        x = x + norm("post_attention_layernorm")(out)
        h = gated_mlp(norm("pre_feedforward_layernorm")(x), a.intermediate_size,
                      a.hidden_size, o.activation, dt, meta.lora_slots, weights)
        x = x + norm("post_feedforward_layernorm")(h)
        return (x, k_cache, v_cache), None


class GemmaFamily(ModelFamily):
    name = "gemma"
    architectures = {
        "Gemma2ForCausalLM": ArchitectureInfo("Gemma 2 2B / 9B / 27B",
                                              sliding_window="every other layer",
                                              soft_cap="attention + final logits"),
        "Gemma3ForCausalLM": ArchitectureInfo("Gemma 3 1B (text)",
                                              sliding_window="5 of 6 layers (layer_types)",
                                              soft_cap="if configured"),
    }
    model_types = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
    gguf_architectures = {"gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
                          "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig")}
    layer_tensors = {
        "input_layernorm": ("input_layernorm.weight", "attn_norm.weight"),
        "post_attention_layernorm": ("post_attention_layernorm.weight",
                                     "post_attention_norm.weight"),
        "pre_feedforward_layernorm": ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
        "post_feedforward_layernorm": ("post_feedforward_layernorm.weight",
                                       "post_ffw_norm.weight"),
        **attention_tensors(),
        **GATED_MLP_TENSORS,
    }
    partition_rules = MEGATRON_RULES
    norm_center = 0.0          # (1 + w): random norms around 0 scale by about 1

    def read_config(self, config: Any, architecture: str) -> ModelArch:
        is_gemma3 = architecture == "Gemma3ForCausalLM"
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention=True (an encoder) is not "
                             "supported")
        activation = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_activation {activation!r}; supported: "
                             f"{', '.join(ACTIVATIONS)}")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # Without layer_types (transformers < 5): Gemma 2 slides on even layers, Gemma 3
        # on all but every sliding_window_pattern-th.
        pattern = int(getattr(config, "sliding_window_pattern", 6) or 6)
        windows = hf_layer_types(
            config, getattr(config, "sliding_window", None),
            (lambda i: bool((i + 1) % pattern)) if is_gemma3 else (lambda i: i % 2 == 0))
        if is_gemma3:
            ropes = _gemma3_ropes(config)
            layer_rope = tuple(0 if w else 1 for w in windows)   # local : global
        else:
            ropes, layer_rope = (Rope.from_dict(hf_rope_parameters(config)),), \
                (0,) * config.num_hidden_layers
        scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim
        options = GemmaOptions(
            rms_norm_eps=float(config.rms_norm_eps),
            activation=activation,
            sm_scale=float(scalar) ** -0.5,
            attn_logit_soft_cap=float(getattr(config, "attn_logit_softcapping", 0) or 0),
            final_logit_soft_cap=float(getattr(config, "final_logit_softcapping", 0) or 0),
            qk_norm=is_gemma3,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            ropes=ropes, layer_rope=layer_rope,
            embed_scale=math.sqrt(config.hidden_size))
        return arch_from_config(config, architecture, options, windows, head_dim=head_dim,
                                max_position_embeddings=8192, tie_word_embeddings=True)

    def gguf_config(self, gguf_arch: str, value: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
        layers = int(value("block_count"))
        heads = int(value("attention.head_count"))
        hidden = int(value("embedding_length"))
        head_dim = int(value("attention.key_length", hidden // heads))
        # llama.cpp: the 27B models scale attention by (hidden / heads) ** -0.5, the rest
        # by head_dim ** -0.5 (GGUF does not store query_pre_attn_scalar).
        is_27b = layers == (46 if gguf_arch == "gemma2" else 62)
        kwargs["query_pre_attn_scalar"] = hidden // heads if is_27b else head_dim
        window = value("attention.sliding_window")
        if window:
            kwargs["sliding_window"] = int(window)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = value(key)
            kwargs[key] = float(cap) if cap else None
        if gguf_arch == "gemma3":
            # sliding_window_pattern: a period (every n-th layer global; llama.cpp's default
            # 6 when absent) or one bool per layer (True = sliding).
            pattern = value("attention.sliding_window_pattern", 6) or 6
            sliding = [bool(p) for p in pattern] if isinstance(pattern, list) else \
                [bool((i + 1) % int(pattern)) for i in range(layers)]
            kwargs["layer_types"] = ["sliding_attention" if s else "full_attention"
                                     for s in sliding]
            global_rope = {"rope_type": "default",
                           "rope_theta": float(value("rope.freq_base", 1000000.0))}
            if value("rope.scaling.type") == "linear":
                global_rope |= {"rope_type": "linear",
                                "factor": float(value("rope.scaling.factor", 1.0))}
            local_base = float(value("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
            kwargs["rope_parameters"] = {
                "full_attention": global_rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": local_base}}
        return kwargs

    def weight_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        H, o = arch.hidden_size, arch.options
        per_layer = {
            "input_layernorm": (H,), "post_attention_layernorm": (H,),
            "pre_feedforward_layernorm": (H,), "post_feedforward_layernorm": (H,),
            **attention_shapes(arch), **gated_mlp_shapes(arch),
            **attention_extra_shapes(arch, qk_norm=o.qk_norm),
            **attention_extra_shapes(arch, qkv_bias=o.attention_bias, o_bias=o.attention_bias),
        }
        return decoder_weight_shapes(arch, per_layer)

    def from_gguf(self, name: str, weight: np.ndarray, arch: ModelArch,
                  gguf_arch: str) -> np.ndarray:
        if name == "norm" or name.endswith("norm"):
            return weight - np.asarray(1.0, weight.dtype)   # llama.cpp stored 1 + w
        return weight

    def build(self, arch, backend, num_blocks, block_size, dtype, plan):
        return CausalLM(arch, GemmaDecoderLayer, PagedCache(backend, num_blocks, block_size),
                        dtype, plan)

    def constants(self, arch: ModelArch) -> dict[str, np.ndarray]:
        o = arch.options
        return layer_constants(arch, [r.inv_freq(arch.head_dim) for r in o.ropes],
                               list(o.layer_rope))


def _gemma3_ropes(config: Any) -> tuple[Rope, Rope]:
    """(local, global) ropes: transformers 5 keys rope_parameters by layer type; 4.x has
    rope_theta + rope_scaling for global layers and rope_local_base_freq for local ones."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {"rope_theta": GEMMA3_LOCAL_ROPE_BASE}
        return Rope.from_dict(local), Rope.from_dict(params["full_attention"])
    local = {"rope_theta": getattr(config, "rope_local_base_freq", GEMMA3_LOCAL_ROPE_BASE)}
    return Rope.from_dict(local), Rope.from_dict(hf_rope_parameters(config))


FAMILY = GemmaFamily()

"""Llama-family decoders: Llama 2/3 (incl. llama3 rope scaling), Mistral, Qwen2, Qwen3, SmolLM.

Pre-norm layers: x += o_proj(attn(norm(x))); x += down(silu(gate) * up)(norm(x)). Qwen2
adds q/k/v biases, Qwen3 q/k RMSNorms, Llama with attention_bias q/k/v/o biases.
Mistral slides a window over every layer; Qwen2/Qwen3 with use_sliding_window over the
layers their `layer_types` name.
"""

from __future__ import annotations

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
    pre_norm_layer,
)
from jaxserve.models.family import (
    GATED_MLP_TENSORS,
    MEGATRON_RULES,
    PRE_NORM_TENSORS,
    ArchitectureInfo,
    ModelFamily,
    arch_from_config,
    attention_extra_shapes,
    attention_shapes,
    attention_tensors,
    decoder_weight_shapes,
    gated_mlp_shapes,
    hf_layer_types,
    stacked_layer_shapes,
)
from jaxserve.models.layers import (
    PagedCache,
    gated_mlp,
)
from jaxserve.models.rope import Rope, hf_rope_parameters


@dataclass(frozen=True, kw_only=True)
class LlamaOptions(DecoderOptions):
    qkv_bias: bool          # Qwen2; Llama with attention_bias
    o_bias: bool            # Llama with attention_bias
    qk_norm: bool           # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope: Rope


class LlamaDecoderLayer(DecoderLayer):

    @nn.compact
    def __call__(self, carry, xs, cos, sin, meta, in_place=None):
        a, o, dt = self.arch, self.arch.options, self.dtype
        attn = attention_config(a, qkv_bias=o.qkv_bias, o_bias=o.o_bias, qk_norm=o.qk_norm)
        return pre_norm_layer(self, carry, xs, cos, sin, meta, attn, lambda h, w: gated_mlp(
            h, a.intermediate_size, a.hidden_size, "silu", dt, meta.lora_slots, w), in_place)


class LlamaFamily(ModelFamily):
    name = "llama"
    architectures = {
        "LlamaForCausalLM": ArchitectureInfo("Llama 2, Llama 3.x, SmolLM2"),
        "MistralForCausalLM": ArchitectureInfo("Mistral 7B",
                                               sliding_window="all layers, if configured"),
        "Qwen2ForCausalLM": ArchitectureInfo("Qwen2, Qwen2.5",
                                             sliding_window="if use_sliding_window"),
        "Qwen3ForCausalLM": ArchitectureInfo("Qwen3 (dense)",
                                             sliding_window="if use_sliding_window"),
    }
    model_types = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    gguf_architectures = {"llama": ("LlamaForCausalLM", "LlamaConfig"),
                          "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
                          "qwen3": ("Qwen3ForCausalLM", "Qwen3Config")}
    layer_tensors = {**PRE_NORM_TENSORS, **attention_tensors(), **GATED_MLP_TENSORS}
    partition_rules = MEGATRON_RULES

    def read_config(self, config: Any, architecture: str) -> ModelArch:
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and \
                not getattr(config, "use_sliding_window", False):
            window = None
        if architecture == "MistralForCausalLM":   # one window for every layer
            windows = (int(window or 0),) * config.num_hidden_layers
        else:   # Qwen: the layers from max_window_layers on
            first = int(getattr(config, "max_window_layers", 0) or 0)
            windows = hf_layer_types(config, window, lambda i: i >= first)
        options = LlamaOptions(
            rms_norm_eps=float(config.rms_norm_eps),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope=Rope.from_dict(hf_rope_parameters(config)))
        return arch_from_config(config, architecture, options, windows)

    def weight_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        H, o = arch.hidden_size, arch.options
        base = {"input_layernorm": (H,), "post_attention_layernorm": (H,),
                **attention_shapes(arch), **gated_mlp_shapes(arch)}
        optional = attention_extra_shapes(arch, qkv_bias=o.qkv_bias, o_bias=o.o_bias,
                                          qk_norm=o.qk_norm)
        # the optional tensors after lm_head: the order fixes the dummy loader's values
        return decoder_weight_shapes(arch, base) | stacked_layer_shapes(arch, optional)

    def from_gguf(self, name: str, weight: np.ndarray, arch: ModelArch,
                  gguf_arch: str) -> np.ndarray:
        return unpermute_llama_qk(name, weight, arch, gguf_arch)

    def build(self, arch, backend, num_blocks, block_size, dtype, plan):
        return CausalLM(arch, LlamaDecoderLayer, PagedCache(backend, num_blocks, block_size),
                        dtype, plan)

    def constants(self, arch: ModelArch) -> dict[str, np.ndarray]:
        return layer_constants(arch, [arch.options.rope.inv_freq(arch.head_dim)])


def unpermute_llama_qk(name: str, weight: np.ndarray, arch: ModelArch,
                       gguf_arch: str) -> np.ndarray:
    """llama.cpp's converter permutes the rows of q and k in "llama" files (Llama's, and
    Mixtral's, which llama.cpp writes as "llama"; not Qwen's): undo it, pass others through."""
    if gguf_arch == "llama" and name == "layers.q_proj.kernel":
        return unpermute_rows(weight, arch.num_heads)
    if gguf_arch == "llama" and name == "layers.k_proj.kernel":
        return unpermute_rows(weight, arch.num_kv_heads)
    return weight


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: ``weight: [num_heads * D, in]`` -> same shape.

    llama.cpp reshapes each head's D rows as (2, D/2) and swaps the axes, interleaving
    the halves that HF's rotate-half pairs; here the inverse: rows as (D/2, 2), swapped.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


FAMILY = LlamaFamily()

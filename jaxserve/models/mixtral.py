"""Mixtral (MixtralForCausalLM): a Llama/Mistral decoder whose MLP is a sparse mixture of
experts (models/moe.py): 8 experts, top-2, the top-2 router weights renormalised (a softmax
over the top-k logits). Attention as Mistral's, with its sliding window on every layer
when configured. Qwen3-MoE (models/qwen3_moe.py) is this family with other names.

Checkpoints name each expert's projections separately (``block_sparse_moe.experts.3.w1``);
the loader stacks them on an expert axis after the layer axis: ``layers.experts_gate_proj
.kernel [L, E, H, I]`` (w1), ``experts_up_proj`` (w3), ``experts_down_proj [L, E, I, H]``
(w2); the router ``block_sparse_moe.gate`` is ``layers.router.kernel [L, H, E]``.

GGUF: llama.cpp writes Mixtral as architecture "llama" with ``llama.expert_count`` and
``llama.expert_used_count`` (the registry routes a "llama" file with experts here,
`reads_gguf`); ``llama.feed_forward_length`` is one expert's intermediate size. Tensors:
the router ``blk.N.ffn_gate_inp`` [E, H], the experts stacked ``blk.N.ffn_{gate,up,down}
_exps`` [E, out, in] (current llama.cpp) or one per expert ``blk.N.ffn_gate.E`` (files
before llama.cpp's merged layout); q and k rows permuted as for Llama, undone in `from_gguf`.
No sliding window is recorded in such files (Mixtral's released configs have none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.mesh import MODEL_AXIS
from jaxserve.models.arch import DecoderOptions, ModelArch
from jaxserve.models.decoder import (
    CausalLM,
    DecoderLayer,
    attention_config,
    layer_constants,
    pre_norm_layer,
)
from jaxserve.models.family import (
    MEGATRON_RULES,
    PRE_NORM_TENSORS,
    REPLICATED,
    ArchitectureInfo,
    ModelFamily,
    arch_from_config,
    attention_extra_shapes,
    attention_shapes,
    attention_tensors,
    decoder_weight_shapes,
)
from jaxserve.models.layers import PagedCache
from jaxserve.models.llama import unpermute_llama_qk
from jaxserve.models.moe import ExpertSharding, MoEConfig, moe_block
from jaxserve.models.rope import Rope, hf_rope_parameters

EXPERT_WEIGHTS = ("experts_gate_proj", "experts_up_proj", "experts_down_proj")


@dataclass(frozen=True, kw_only=True)
class MoEOptions(DecoderOptions):
    rope: Rope
    moe: MoEConfig
    qk_norm: bool = False              # Qwen3-MoE
    attention_bias: bool = False       # Qwen3-MoE with attention_bias (q/k/v/o)
    experts: ExpertSharding | None = None   # set by arch_for_mesh when sharded


class MoEDecoderLayer(DecoderLayer):
    """x += o_proj(attn(norm(x))); x += moe(norm(x))."""

    @nn.compact
    def __call__(self, carry, xs, cos, sin, meta, in_place=None):
        a, o, dt = self.arch, self.arch.options, self.dtype
        attn = attention_config(a, qkv_bias=o.attention_bias, o_bias=o.attention_bias,
                                qk_norm=o.qk_norm)
        return pre_norm_layer(self, carry, xs, cos, sin, meta, attn,
                              lambda h, w: moe_block(h, o.moe, o.experts, dt, w), in_place)


class MixtralFamily(ModelFamily):
    name = "mixtral"
    architectures = {
        "MixtralForCausalLM": ArchitectureInfo(
            "Mixtral 8x7B / 8x22B", sliding_window="all layers, if configured",
            moe="softmax top-k, renormalised", expert_parallel="yes (--enable-expert-parallel)"),
    }
    model_types = {"mixtral": "MixtralForCausalLM"}
    gguf_architectures = {"llama": ("MixtralForCausalLM", "MixtralConfig")}
    layer_tensors = {
        **PRE_NORM_TENSORS, **attention_tensors(),
        "router.kernel": ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
        "experts_gate_proj.kernel": ("block_sparse_moe.experts.{expert}.w1.weight",
                                     ("ffn_gate_exps.weight", "ffn_gate.{expert}.weight")),
        "experts_up_proj.kernel": ("block_sparse_moe.experts.{expert}.w3.weight",
                                   ("ffn_up_exps.weight", "ffn_up.{expert}.weight")),
        "experts_down_proj.kernel": ("block_sparse_moe.experts.{expert}.w2.weight",
                                     ("ffn_down_exps.weight", "ffn_down.{expert}.weight")),
    }
    partition_rules = {**MEGATRON_RULES, "router": REPLICATED}

    # -- GGUF --------------------------------------------------------------------------------
    def reads_gguf(self, gguf_arch: str, value: Any) -> bool:
        return bool(value("expert_count", 0))   # a "llama" file without experts is Llama's

    def gguf_config(self, gguf_arch: str, value: Any) -> dict[str, Any]:
        # feed_forward_length (one expert's) is read as intermediate_size by the loader.
        return {"num_local_experts": int(value("expert_count")),
                "num_experts_per_tok": int(value("expert_used_count")),
                "sliding_window": None}

    def from_gguf(self, name: str, weight: np.ndarray, arch: ModelArch,
                  gguf_arch: str) -> np.ndarray:
        return unpermute_llama_qk(name, weight, arch, gguf_arch)

    # -- config ------------------------------------------------------------------------------
    def read_config(self, config: Any, architecture: str) -> ModelArch:
        window = int(getattr(config, "sliding_window", None) or 0)
        return self._arch(config, architecture, (window,) * config.num_hidden_layers,
                          MoEConfig(num_experts=int(config.num_local_experts),
                                    top_k=int(config.num_experts_per_tok),
                                    intermediate_size=int(config.intermediate_size),
                                    renormalize=True,
                                    activation=getattr(config, "hidden_act", "silu")))

    def _arch(self, config: Any, architecture: str, windows: tuple[int, ...], moe: MoEConfig,
              **options: Any) -> ModelArch:
        if moe.activation != "silu":
            raise ValueError(f"hidden_act={moe.activation!r} is not supported for "
                             f"{architecture}; supported: silu")
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"num_experts_per_tok={moe.top_k} must be in [1, "
                             f"{moe.num_experts}] (the number of experts)")
        opts = MoEOptions(rms_norm_eps=float(config.rms_norm_eps),
                          rope=Rope.from_dict(hf_rope_parameters(config)), moe=moe, **options)
        return arch_from_config(config, architecture, opts, windows,
                                intermediate_size=moe.intermediate_size,  # one expert's
                                max_position_embeddings=4096)

    # -- weights -----------------------------------------------------------------------------
    def weight_shapes(self, arch: ModelArch) -> dict[str, tuple[int, ...]]:
        H, o = arch.hidden_size, arch.options
        E, I = o.moe.num_experts, o.moe.intermediate_size
        per_layer = {
            "input_layernorm": (H,), "post_attention_layernorm": (H,), **attention_shapes(arch),
            "router.kernel": (H, E),
            "experts_gate_proj.kernel": (E, H, I), "experts_up_proj.kernel": (E, H, I),
            "experts_down_proj.kernel": (E, I, H),
            **attention_extra_shapes(arch, qk_norm=o.qk_norm),
            **attention_extra_shapes(arch, qkv_bias=o.attention_bias, o_bias=o.attention_bias),
        }
        return decoder_weight_shapes(arch, per_layer)

    # -- tensor / expert parallelism ---------------------------------------------------------
    def arch_for_mesh(self, arch: ModelArch, mesh: Any, expert_parallel: bool) -> ModelArch:
        if mesh is None or mesh.shape[MODEL_AXIS] == 1:
            return arch
        tp, moe = mesh.shape[MODEL_AXIS], arch.options.moe
        if expert_parallel and moe.num_experts % tp:
            raise ValueError(f"--enable-expert-parallel needs the number of experts "
                             f"({moe.num_experts}) to be a multiple of tensor_parallel_size "
                             f"({tp})")
        if not expert_parallel and moe.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' "
                             f"intermediate size ({moe.intermediate_size}); try "
                             f"--enable-expert-parallel")
        sharding = ExpertSharding(mesh, expert_parallel)
        return dataclasses.replace(arch, options=dataclasses.replace(arch.options,
                                                                     experts=sharding))

    def param_spec_for(self, arch: ModelArch):
        sharding: ExpertSharding | None = arch.options.experts

        def spec(path: tuple[str, ...], shape: tuple[int, ...], tp: int) -> P:
            module = path[1] if path[0] == "layers" and len(path) == 3 else path[0]
            if tp > 1 and module in EXPERT_WEIGHTS:
                one_layer = sharding.weight_specs()[EXPERT_WEIGHTS.index(module)]
                return P(None, *one_layer)               # [L, E, ...]: the layer axis whole
            return self.param_spec(path, shape, tp)

        return spec

    # -- forward -----------------------------------------------------------------------------
    def build(self, arch, backend, num_blocks, block_size, dtype, plan):
        return CausalLM(arch, MoEDecoderLayer, PagedCache(backend, num_blocks, block_size),
                        dtype, plan)

    def constants(self, arch: ModelArch) -> dict[str, np.ndarray]:
        return layer_constants(arch, [arch.options.rope.inv_freq(arch.head_dim)])


FAMILY = MixtralFamily()

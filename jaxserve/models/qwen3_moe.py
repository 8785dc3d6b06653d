"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k RMSNorms) with the Mixtral layer's
mixture of experts (models/mixtral.py, models/moe.py); the differences are the names and
the router: softmax over all experts, then the top k, renormalised only if
`norm_topk_prob` (Qwen3-30B-A3B and -235B-A22B set it).

Every layer must be a MoE layer (`decoder_sparse_step` 1, no `mlp_only_layers`, the
released models' configs): the layers run under one scan, whose body is one layer kind.
Other configs are rejected naming the field.

GGUF ("qwen3moe"): llama.cpp stores each layer's experts stacked (``ffn_gate_exps`` [E, I, H]
in HF orientation, which the loader transposes per expert) and always renormalises the
top-k weights for this architecture (its build passes norm_w = true; the converter writes
no norm_topk_prob), so a GGUF config gets norm_topk_prob=True unless the file says
otherwise in expert_weights_norm.
"""

from __future__ import annotations

from typing import Any

from jaxserve.models.arch import ModelArch
from jaxserve.models.family import PRE_NORM_TENSORS, ArchitectureInfo, attention_tensors
from jaxserve.models.mixtral import MixtralFamily
from jaxserve.models.moe import MoEConfig


class Qwen3MoeFamily(MixtralFamily):
    name = "qwen3_moe"
    architectures = {
        "Qwen3MoeForCausalLM": ArchitectureInfo(
            "Qwen3-30B-A3B, Qwen3-235B-A22B", sliding_window="all layers, if "
            "use_sliding_window", moe="softmax top-k, renormalised if norm_topk_prob",
            expert_parallel="yes (--enable-expert-parallel)"),
    }
    model_types = {"qwen3_moe": "Qwen3MoeForCausalLM"}
    gguf_architectures = {"qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig")}
    layer_tensors = {
        **PRE_NORM_TENSORS, **attention_tensors(),
        "router.kernel": ("mlp.gate.weight", "ffn_gate_inp.weight"),
        "experts_gate_proj.kernel": ("mlp.experts.{expert}.gate_proj.weight",
                                     "ffn_gate_exps.weight"),
        "experts_up_proj.kernel": ("mlp.experts.{expert}.up_proj.weight", "ffn_up_exps.weight"),
        "experts_down_proj.kernel": ("mlp.experts.{expert}.down_proj.weight",
                                     "ffn_down_exps.weight"),
    }

    def gguf_config(self, gguf_arch: str, value: Any) -> dict[str, Any]:
        return {"num_experts": int(value("expert_count")),
                "num_experts_per_tok": int(value("expert_used_count")),
                "moe_intermediate_size": int(value("expert_feed_forward_length")),
                "norm_topk_prob": bool(value("expert_weights_norm", True))}

    def read_config(self, config: Any, architecture: str) -> ModelArch:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense_layers = list(getattr(config, "mlp_only_layers", None) or [])
        if dense_layers:
            raise ValueError(f"Qwen3-MoE with dense MLP layers (mlp_only_layers={dense_layers}) "
                             "is not supported: every layer must be a MoE layer")
        if step != 1:
            raise ValueError(f"Qwen3-MoE with decoder_sparse_step={step} (dense MLP layers "
                             "between MoE layers) is not supported; only 1 (every layer MoE)")
        window = int(getattr(config, "sliding_window", None) or 0) \
            if getattr(config, "use_sliding_window", False) else 0
        moe = MoEConfig(num_experts=int(config.num_experts),
                        top_k=int(config.num_experts_per_tok),
                        intermediate_size=int(config.moe_intermediate_size),
                        renormalize=bool(getattr(config, "norm_topk_prob", False)),
                        activation=getattr(config, "hidden_act", "silu"))
        return self._arch(config, architecture, (window,) * config.num_hidden_layers, moe,
                          qk_norm=True,
                          attention_bias=bool(getattr(config, "attention_bias", False)))


FAMILY = Qwen3MoeFamily()

"""The architecture facts the model code needs, read once from an HF config."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool          # Qwen2; Llama with attention_bias
    o_bias: bool            # Llama with attention_bias
    qk_norm: bool           # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None
    rope_theta: float
    rope_type: str          # "default" | "llama3" | "linear"
    rope_params: tuple[tuple[str, Any], ...]  # the rest of the rope config, hashable

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelArch":
        archs = list(getattr(config, "architectures", None) or [])
        architecture = archs[0] if archs else _arch_from_model_type(config)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(getattr(config, "attention_bias", False))
        rope = _rope_config(config)
        sliding = getattr(config, "sliding_window", None)
        if architecture == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
            sliding = None
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=sliding,
            rope_theta=float(rope.pop("rope_theta", 10000.0)),
            rope_type=str(rope.pop("rope_type", "default")),
            rope_params=tuple(sorted(rope.items())),
        )

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2], with llama3 / linear scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        params = dict(self.rope_params)
        if self.rope_type in ("default", None):
            return inv.astype(np.float32)
        if self.rope_type == "linear":
            return (inv / float(params["factor"])).astype(np.float32)
        if self.rope_type == "llama3":
            factor = float(params["factor"])
            low = float(params.get("low_freq_factor", 1.0))
            high = float(params.get("high_freq_factor", 4.0))
            old_len = float(params["original_max_position_embeddings"])
            low_wavelen, high_wavelen = old_len / low, old_len / high
            wavelen = 2 * np.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        raise ValueError(f"unsupported rope_scaling type {self.rope_type!r}; supported: "
                         "default, linear, llama3")


def _rope_config(config: Any) -> dict[str, Any]:
    """Normalise transformers 4.x (rope_theta + rope_scaling) and 5.x (rope_parameters)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        rope = dict(params)
    else:
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    # Only plain-value entries matter for us; keep them hashable.
    return {k: v for k, v in rope.items() if isinstance(v, (int, float, str, type(None)))}


def _arch_from_model_type(config: Any) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
        getattr(config, "model_type", ""), f"<model_type {getattr(config, 'model_type', '?')}>")

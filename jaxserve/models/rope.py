"""Rotary position embeddings: reading HF rope configs and their inverse frequencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    theta: float
    rope_type: str = "default"
    params: tuple[tuple[str, Any], ...] = ()   # the rest of the rope config, hashable

    @classmethod
    def from_dict(cls, rope: dict[str, Any]) -> Rope:
        rope = dict(rope)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.pop("type", None)
        theta = float(rope.pop("rope_theta", 10000.0))
        rope_type = str(rope.pop("rope_type", None) or "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        # Only plain-value entries matter for us; keep them hashable.
        plain = {k: v for k, v in rope.items() if isinstance(v, (int, float, str, type(None)))}
        return cls(theta, rope_type, tuple(sorted(plain.items())))

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] float32, with linear / llama3 scaling applied."""
        d = head_dim
        inv = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        params = dict(self.params)
        if self.rope_type == "linear":
            inv = inv / float(params["factor"])
        elif self.rope_type == "llama3":
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
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)


def hf_rope_parameters(config: Any) -> dict[str, Any]:
    """One rope dict from transformers 4.x (rope_theta + rope_scaling) or 5.x
    (rope_parameters). Per-layer-type rope configs (Gemma 3) are read by their model."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        return dict(params)
    rope = dict(getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope

"""The facts about a model that the engine needs, whatever the architecture.

The runner, the memory plan and `parallel/` read only these fields; everything a
family needs beyond them (norm flavour, biases, rope, soft caps) lives in `options`,
a `DecoderOptions` subclass owned by the model module that read the config (models/registry.py
says which module that is).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DecoderOptions:
    """What models/decoder.py's CausalLM reads from every family's options; a family's
    own options subclass this (keyword-only, so subclasses may add required fields)."""
    rms_norm_eps: float
    norm_offset: float = 0.0                # RMSNorm scales by (norm_offset + w)
    embed_scale: float | None = None        # embeddings times this (None: 1)
    final_logit_soft_cap: float = 0.0       # cap * tanh(logits / cap); 0: off


@dataclass(frozen=True)
class ModelArch:
    architecture: str         # Hugging Face `architectures[0]`, a key of the registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Per layer: its sliding window in tokens, 0 for full attention. Every layer keeps
    # its KV in the one shared cache; a window only bounds what attention reads.
    layer_windows: tuple[int, ...] = ()
    options: DecoderOptions | None = None   # the family's own subclass

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def sliding_window(self) -> int | None:
        """The widest sliding window of any layer (None: every layer attends in full)."""
        return max(self.layer_windows, default=0) or None

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.layer_windows)

"""One pipeline stage of a decoder: its slice of the layer stack, its parameters, its model.

A stage runs layers [first, end) of the model (jaxserve/pipeline_layout.py decides which).
Its parameters are the full model's with the stacked layer weights sliced on their leading
layer axis, plus the embeddings on the first stage and the final norm and LM head on the
last (a tied LM head is the embedding table: the last stage holds a copy). Its model is
`StageLM`: the family's own `CausalLM` built for a model of ``end - first`` layers, whose
``__call__`` takes token ids on the first stage and the previous stage's hidden states
[T, H] (float32, the residual stream) on every other. Layer indices inside a stage are
local, so the stage's KV cache holds only its own layers: ``[(end - first) * num_blocks,
block_size, Hkv, D]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.arch import ModelArch
from jaxserve.models.decoder import CausalLM
from jaxserve.pipeline_layout import StageLayers
from jaxserve.step_inputs import AttentionMetadata

# Per-layer constants (models/decoder.py layer_constants): sliced like the layers.
PER_LAYER_CONSTANTS = ("layer_windows", "layer_rope")


def stage_arch(arch: ModelArch, stage: StageLayers) -> ModelArch:
    """The architecture of a model made of this stage's layers only."""
    windows = tuple(arch.layer_windows[stage.first:stage.end]) if arch.layer_windows else ()
    return dataclasses.replace(arch, num_layers=stage.num_layers, layer_windows=windows)


def stage_constants(constants: dict[str, np.ndarray], stage: StageLayers
                    ) -> dict[str, np.ndarray]:
    """A family's per-step constants for this stage's layers (rotary tables whole)."""
    return {name: value[stage.first:stage.end] if name in PER_LAYER_CONSTANTS else value
            for name, value in constants.items()}


def stage_params(params: Any, stage: StageLayers, tied_embeddings: bool) -> Any:
    """This stage's part of a (host) params tree ``{"params": {...}}``: every stacked layer
    weight sliced to its layers; ``embed_tokens`` on the first stage (and the last, for a
    tied LM head), ``norm`` and ``lm_head`` on the last."""
    tree = params["params"]
    out: dict[str, Any] = {}
    for name, value in tree.items():
        if name == "layers":
            out[name] = jax.tree.map(lambda w: w[stage.first:stage.end], value)
        elif name == "embed_tokens":
            if stage.is_first or (stage.is_last and tied_embeddings):
                out[name] = value
        elif stage.is_last:          # norm, lm_head: what turns hidden states into logits
            out[name] = value
    return {"params": out}


class StageLM(CausalLM):
    """`CausalLM` over one stage's layers (see the module docstring). ``logits`` is
    CausalLM's and runs on the last stage only."""
    is_first: bool = True

    def __call__(self, inputs, positions, meta: AttentionMetadata, k_cache, v_cache,
                 constants: dict[str, jax.Array]):
        """inputs: token ids [T] on the first stage, hidden states [T, H] float32 after it
        → (hidden states [T, H], caches)."""
        x = self.embed(inputs) if self.is_first else inputs.astype(jnp.float32)
        return self.run_layers(x, positions, meta, k_cache, v_cache, constants)


def stage_model(model: CausalLM, stage: StageLayers) -> StageLM:
    """The family's model (built for the stage's arch) as a stage of the pipeline."""
    return StageLM(model.arch, model.layer, model.cache, model.dtype, model.plan,
                   is_first=stage.is_first)

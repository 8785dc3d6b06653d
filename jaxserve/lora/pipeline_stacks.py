"""The adapter slots of a pipeline-parallel engine: one `LoRAStacks` per stage, holding
only that stage's layers.

Stage ``s`` (layers [first, end), jaxserve/pipeline_layout.py) keeps A [L_s, S, in, r] and
B [L_s, S, r, out] on its own (1, tp) sub-mesh, split like its base kernels
(lora/stacks.py), and its program applies them to its own layers
(runner/pipeline_runner.py). `write` puts each stage's slice of an adapter's layers into the
same slot on every stage, so a slot means one adapter across the pipeline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.lora.peft_loader import LoRAWeights
from jaxserve.lora.stacks import LoRAStacks
from jaxserve.pipeline_layout import StageLayers


class PipelineLoRAStacks:
    """`LoRAStacks`' interface over the stages' stacks (``arrays``: one dict per stage)."""

    def __init__(self, stages: list[LoRAStacks], layers: list[StageLayers]) -> None:
        """stages: each stage's stacks, built for its layers and mesh; layers: the stages'
        layer ranges, in the same order."""
        if len(stages) != len(layers):
            raise ValueError(f"{len(stages)} stage stacks for {len(layers)} stages")
        self.stages, self.layers = stages, layers
        first = stages[0]
        self.targets, self.dtype = first.targets, first.dtype
        self.max_loras, self.max_lora_rank = first.max_loras, first.max_lora_rank
        self.num_layers = sum(stage.num_layers for stage in layers)

    @property
    def arrays(self) -> list[Any]:
        return [stage.arrays for stage in self.stages]

    @property
    def nbytes(self) -> int:
        return sum(stage.nbytes for stage in self.stages)

    def write(self, slot: int, weights: LoRAWeights | None) -> None:
        """Put an adapter (None: zeros) into ``slot``: each stage gets its layers' slices."""
        for stage, layers in zip(self.stages, self.layers):
            part = None
            if weights is not None:
                part = dataclasses.replace(
                    weights,
                    a={t: w[layers.first:layers.end] for t, w in weights.a.items()},
                    b={t: w[layers.first:layers.end] for t, w in weights.b.items()})
            stage.write(slot, part)

"""How a model's step runs: a static plan the model is built with, one name per setting.

The model is called with everything it needs (parameters, KV cache, attention metadata,
constants) and built with this plan: nothing is set on it afterwards and nothing is found by
probing it. Who chooses the plan for a platform: the runner (runner/execution_plan.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_LIBRARY_ROWS = 512    # steps of at most this many tokens take the CPU library (largest bucket)


class LayerLoop(str, enum.Enum):
    """The decoder's loop over layers and the layout of the layer weights it reads."""
    # One while loop over weights stacked [L, ...]: compile time flat in depth; a dot on a
    # layer's slice makes XLA copy the slice every step, so on the CPU the projections read
    # the stack in place through the matmul library (`cpu_matmul`).
    SCANNED = "scanned"
    # The same scan fully unrolled: straight-line layers whose slices of the stack have
    # constant offsets, which the GPU's dots read in place.
    UNROLLED = "unrolled"
    # Each layer's weights in their own buffers (models/decoder.per_layer_weights splits the
    # stack once), a Python loop over layers: straight-line like UNROLLED, and no slice at all.
    PER_LAYER = "per-layer"


@dataclass(frozen=True)
class ExecutionPlan:
    """The static choices of one compiled model (part of the executable cache's key)."""
    layer_loop: LayerLoop = LayerLoop.SCANNED
    # Projections (float32 / bfloat16, int8, GGUF blocks) and a tied LM head of steps of at
    # most `max_library_rows` tokens call the CPU matmul library (kernels/cpu/matmul.py) on
    # their weights read in place, instead of XLA's dot (the CPU, one device).
    cpu_matmul: bool = False
    # With cpu_matmul: float projections and the tied LM head of at most this many rows take
    # the library's streaming GEMV instead of oneDNN (kernels/cpu/gemv_choice.py measures it).
    gemv_rows: int = 0
    max_library_rows: int = MAX_LIBRARY_ROWS
    # With cpu_matmul: projection weights packed at startup into oneDNN's blocked layout
    # (engine/weight_packing.py), which only the library reads: every step hands the layers
    # their weights in place (above max_library_rows plain weights keep XLA's dot).
    packed_weights: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.layer_loop, LayerLoop):
            object.__setattr__(self, "layer_loop", LayerLoop(self.layer_loop))
        if self.gemv_rows < 0 or self.max_library_rows < 0:
            raise ValueError(f"gemv_rows ({self.gemv_rows}) and max_library_rows "
                             f"({self.max_library_rows}) must be >= 0")

    def library_rows(self, num_tokens: int) -> bool:
        """Whether a step of num_tokens tokens takes the CPU library for its projections."""
        return self.cpu_matmul and num_tokens <= self.max_library_rows

    def reads_in_place(self, num_tokens: int) -> bool:
        """Whether a step of num_tokens tokens hands its layers their weights in place:
        where it takes the library, and at every row count for packed weights."""
        return self.library_rows(num_tokens) or (self.cpu_matmul and self.packed_weights)

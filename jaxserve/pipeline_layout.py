"""Pipeline parallel layout: which layers each stage runs, and the devices each stage owns.

`--pipeline-parallel-size P` splits the layer stack into P contiguous stages. Stage ``s``
runs layers ``[first, end)`` on its own ``(1, tp)`` sub-mesh of the device list (stage 0 on
devices ``[0, tp)``, stage 1 on ``[tp, 2 tp)``, ...), with its weights and its own layers' KV
cache there; embeddings live on the first stage, the final norm and the LM head on the last.

The split is vLLM's (``get_pp_indices``): ``num_layers // P`` layers per stage, and the
remainder one each to the stages *before* the last, from the second-to-last backwards (the
last stage also runs the LM head and the sampler):

    stage_layer_counts(32, 4)  -> [8, 8, 8, 8]
    stage_layer_counts(10, 4)  -> [2, 3, 3, 2]
    stage_layer_counts(7, 2)   -> [4, 3]
    stage_layer_counts(32, 3, "10,11,11") -> [10, 11, 11]   # --pp-layer-partition
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.mesh import AXES


def stage_layer_counts(num_layers: int, pipeline_parallel_size: int,
                       partition: str | None = None) -> list[int]:
    """Layers per stage (see the module docstring); ValueError on a split that cannot be."""
    pp = pipeline_parallel_size
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    if partition:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            raise ValueError(f"pp_layer_partition must be comma-separated layer counts, got "
                             f"{partition!r}") from None
        if len(counts) != pp or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition {partition!r} must name {pp} stages of at "
                             f"least one layer each, summing to the model's {num_layers} "
                             f"layers")
        return counts
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} "
                         "layers: every stage needs at least one layer")
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return counts


@dataclass(frozen=True)
class StageLayers:
    """One stage's slice of the layer stack: layers [first, end)."""
    index: int
    first: int
    end: int
    num_stages: int

    @property
    def num_layers(self) -> int:
        return self.end - self.first

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_layers(num_layers: int, pipeline_parallel_size: int,
                 partition: str | None = None) -> list[StageLayers]:
    """Every stage's layer range, in order."""
    counts = stage_layer_counts(num_layers, pipeline_parallel_size, partition)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return [StageLayers(i, bounds[i], bounds[i + 1], len(counts)) for i in range(len(counts))]


def stage_meshes(pipeline_parallel_size: int, tensor_parallel_size: int,
                 devices: Sequence[jax.Device] | None = None) -> list[Mesh]:
    """One (1, tp) mesh (axes ``('data', 'model')``) per stage over consecutive devices, so
    partition specs are the tensor-parallel ones on every stage.

    Across processes (jax.distributed) the devices are taken process by process, the stages
    must cover every device, and each stage's devices must sit in one process: pipeline
    stages cross hosts, tensor parallelism stays within one."""
    pp, tp = pipeline_parallel_size, tensor_parallel_size
    devices = list(devices) if devices is not None else jax.devices()
    needed = pp * tp
    if jax.process_count() > 1:
        devices = sorted(devices, key=lambda d: (d.process_index, d.id))
        check_stages_in_processes(pp, tp, devices)
    if needed > len(devices):
        # The hint applies to the CPU (the only platform whose devices can be simulated);
        # it is given on every platform, as this leaf module asks no platform questions.
        hint = (" (on CPU, simulate devices with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={needed})")
        raise ValueError(f"pipeline_parallel_size ({pp}) x tensor_parallel_size ({tp}) needs "
                         f"{needed} devices, but only {len(devices)} are visible{hint}")
    return [Mesh(np.array(devices[s * tp:(s + 1) * tp], dtype=object).reshape(1, tp), AXES)
            for s in range(pp)]


def check_stages_in_processes(pipeline_parallel_size: int, tensor_parallel_size: int,
                              devices: Sequence[jax.Device]) -> None:
    """A multi-process run's layout rules (see `stage_meshes`); ValueError naming the sizes."""
    pp, tp = pipeline_parallel_size, tensor_parallel_size
    processes = len({d.process_index for d in devices})
    if pp * tp != len(devices):
        raise ValueError(f"a multi-process run must use every device: "
                         f"pipeline_parallel_size ({pp}) x tensor_parallel_size ({tp}) x "
                         f"data_parallel_size (1) = {pp * tp}, but the {processes} processes "
                         f"have {len(devices)} devices together")
    for stage in range(pp):
        owners = sorted({d.process_index for d in devices[stage * tp:(stage + 1) * tp]})
        if len(owners) > 1:
            raise ValueError(f"pipeline stage {stage}'s {tp} devices would span processes "
                             f"{owners}: a stage's devices must be in one process, so "
                             f"tensor_parallel_size ({tp}) must divide each process's device "
                             f"count")

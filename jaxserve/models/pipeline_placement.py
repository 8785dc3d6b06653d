"""Where a pipeline-parallel engine's model lives: one `ModelPlacement` per stage.

`ModelPlacement.create` returns a `PipelinePlacement` when pipeline_parallel_size > 1.
It answers `setup_model`'s questions as a `ModelPlacement` does, for the whole engine:
parameters are placed stage by stage (each stage's slice of the host params straight onto
its own (1, tp) sub-mesh: no device ever holds another stage's weights), the step's inputs
and sampling state live on the last stage (it samples), and the attention backend is
sharded per stage by the runner (runner/pipeline_runner.py), not here.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.attention.backend import AttentionBackend
from jaxserve.config import ParallelConfig
from jaxserve.models import partition
from jaxserve.models.arch import ModelArch
from jaxserve.models.pipeline_stage import stage_arch, stage_params
from jaxserve.pipeline_layout import StageLayers, stage_layers, stage_meshes

logger = logging.getLogger(__name__)


@dataclass
class PipelinePlacement:
    stages: list[Any]              # a ModelPlacement per stage (its mesh, its stage arch)
    layers: list[StageLayers]      # each stage's layer range
    arch: ModelArch                # the whole model as the stages run it (tp applied)
    source_arch: ModelArch         # the checkpoint's architecture

    @classmethod
    def create(cls, parallel: ParallelConfig, arch: ModelArch,
               devices: list[jax.Device] | None = None) -> PipelinePlacement:
        """devices: this engine's (a data-parallel replica's pp x tp); default: the first
        pp x tp devices."""
        from jaxserve.models.placement import ModelPlacement

        pp, tp = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
        layers = stage_layers(arch.num_layers, pp, parallel.pp_layer_partition)
        meshes = stage_meshes(pp, tp, devices)
        one_stage = dataclasses.replace(parallel, pipeline_parallel_size=1)
        stages = [ModelPlacement.create(one_stage, stage_arch(arch, stage), mesh)
                  for stage, mesh in zip(layers, meshes)]
        logger.info("pipeline parallel %d: layers per stage %s, each stage on %d device(s) "
                    "[%s]", pp, [s.num_layers for s in layers], tp,
                    "; ".join(",".join(str(d.id) for d in m.devices.flat) for m in meshes))
        return cls(stages=stages, layers=layers, arch=partition.arch_for_tp(arch, tp),
                   source_arch=arch)

    # -- ModelPlacement's interface, for the whole engine --------------------------------------
    @property
    def mesh(self) -> Any:
        """The first stage's mesh (what asks for one mesh: logs, per-device choices)."""
        return self.stages[0].mesh

    def is_local(self, stage: int) -> bool:
        """Whether this process holds stage ``stage``'s devices (every stage, in one process;
        across processes each stage's devices are in exactly one, pipeline_layout.py)."""
        return all(d.process_index == jax.process_index()
                   for d in self.stages[stage].mesh.devices.flat)

    def process_of(self, stage: int) -> int:
        """The process that runs stage ``stage``."""
        return self.stages[stage].mesh.devices.flat[0].process_index

    @property
    def tp(self) -> int:
        return self.stages[0].tp

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def device(self) -> jax.Device | None:
        return self.stages[0].device

    @property
    def kv_sharding(self) -> NamedSharding | None:
        return None               # one per stage: the runner asks each stage

    @property
    def input_sharding(self) -> NamedSharding | None:
        """Step inputs and sampling state: on the last stage, which samples."""
        return self.stages[-1].input_sharding

    @property
    def logits_shardings(self) -> tuple[NamedSharding, ...]:
        return self.stages[-1].logits_shardings

    def prepare(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.stages[0].prepare(weights)

    def place(self, params: Any) -> list[Any]:
        """Host params → one device params tree per stage, each on its stage's devices.
        Across processes a stage of another process is its ShapeDtypeStructs (shardings
        included): nothing of it is allocated here."""
        tied = self.arch.tie_word_embeddings
        placed = [stage.place(stage_params(params, layers, tied)) if self.is_local(index)
                  else _param_structs(stage, stage_params(params, layers, tied))
                  for index, (stage, layers) in enumerate(zip(self.stages, self.layers))]
        logger.info("parameters per stage: %s MiB on each device", ", ".join(
            f"{partition.per_device_bytes(p) / 2**20:.1f}" for p in placed))
        return placed

    def weight_bytes_per_device(self, params: Any, total_bytes: int) -> int:
        """The busiest stage's bytes per device."""
        return max(partition.per_device_bytes(p) for p in params)

    def shard_backend(self, backend: AttentionBackend) -> AttentionBackend:
        return backend            # sharded per stage by the runner (each stage's own mesh)

    def agree(self, plan: Any) -> Any:
        return self.stages[0].agree(plan)


def _param_structs(stage: Any, params: Any) -> Any:
    """A stage's host params as the ShapeDtypeStructs its `place` would give (partition.py's
    specs on its mesh)."""
    from jaxserve.models.registry import family_for

    specs = partition.param_specs(params, stage.tp,
                                  family_for(stage.arch.architecture).param_spec_for(stage.arch))
    return jax.tree.map(lambda value, spec: jax.ShapeDtypeStruct(
        np.shape(value), np.asarray(value).dtype, sharding=NamedSharding(stage.mesh, spec)),
        params, specs)

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

        if jax.process_count() > 1:
            raise ValueError("pipeline_parallel_size > 1 across processes is not supported "
                             "yet")
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
        """Host params → one device params tree per stage, each on its stage's devices."""
        tied = self.arch.tie_word_embeddings
        placed = [stage.place(stage_params(params, layers, tied))
                  for stage, layers in zip(self.stages, self.layers)]
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

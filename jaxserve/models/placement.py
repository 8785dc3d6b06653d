"""Where one engine's model lives: a single device, or a (1, tp) mesh it is sharded over.

`setup_model` asks a `ModelPlacement` five things and stays ignorant of meshes:

    placement = ModelPlacement.create(config.parallel_config, arch, mesh)
    arch = placement.arch                                   # KV heads replicated if tp needs it
    params = placement.place(family.params_from_weights(placement.prepare(weights), arch))
    kv_plan = placement.agree(plan_kv_cache(..., tp_size=placement.tp, device=placement.device))
    backend = placement.shard_backend(backend)              # attention per shard (shard_map)

Without a mesh (tp = 1, one process) every answer is the single-device one
(`jax.device_put`, no shardings), so that path is exactly what it was.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.attention.backend import AttentionBackend
from jaxserve.config import ParallelConfig
from jaxserve.mesh import MODEL_AXIS, describe, make_mesh, replicated
from jaxserve.models import partition
from jaxserve.models.arch import ModelArch
from jaxserve.models.registry import family_for

logger = logging.getLogger(__name__)


@dataclass
class ModelPlacement:
    mesh: Mesh | None            # None: the default device, unsharded
    arch: ModelArch              # what the sharded model runs (KV heads possibly replicated)
    source_arch: ModelArch       # the checkpoint's architecture

    @classmethod
    def create(cls, parallel: ParallelConfig, arch: ModelArch,
               mesh: Mesh | None = None) -> ModelPlacement:
        """The placement for one engine. `mesh` is a data-parallel replica's sub-mesh; without
        one, tp > 1 (or a multi-process run) builds a (1, tp) mesh over the first devices.
        pipeline_parallel_size > 1: a PipelinePlacement (a placement per stage)."""
        if mesh is None and parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs one engine core per replica behind "
                             "jaxserve.parallel.launch.create_engine_core (LLM and `jaxserve "
                             "serve` use it); EngineCore alone holds one replica")
        if parallel.pipeline_parallel_size > 1:    # a data-parallel replica's row, or none
            from jaxserve.models.pipeline_placement import PipelinePlacement

            return PipelinePlacement.create(
                parallel, arch, None if mesh is None else list(mesh.devices.flat))
        tp = mesh.shape[MODEL_AXIS] if mesh is not None else parallel.tensor_parallel_size
        partition.check_tp_size(arch, tp)
        if mesh is None:
            if tp > 1 or jax.process_count() > 1:
                mesh = make_mesh(tp, 1)
        if mesh is not None:
            logger.info("tensor parallel %d on a %s", tp, describe(mesh))
        # The family may record the mesh in its arch (mixture of experts: which experts or
        # which slice of each expert a device holds, and the mesh its shard_map runs on).
        sharded = family_for(arch.architecture).arch_for_mesh(
            partition.arch_for_tp(arch, tp), mesh, parallel.enable_expert_parallel)
        return cls(mesh=mesh, arch=sharded, source_arch=arch)

    @property
    def tp(self) -> int:
        return self.mesh.shape[MODEL_AXIS] if self.mesh is not None else 1

    @property
    def device(self) -> jax.Device | None:
        """A device of this engine (memory planning is per device)."""
        return self.mesh.devices.flat[0] if self.mesh is not None else None

    @property
    def kv_sharding(self) -> NamedSharding | None:
        return partition.kv_cache_sharding(self.mesh) if self.mesh is not None else None

    @property
    def input_sharding(self) -> NamedSharding | None:
        """Step inputs (token ids, metadata, sampling tensors): replicated on the mesh."""
        return replicated(self.mesh) if self.mesh is not None else None

    @property
    def logits_shardings(self) -> tuple[NamedSharding, ...]:
        """Constraints the step puts on the logits [S, V] before sampling: split on vocab as
        the lm_head computes them (so XLA never gathers the lm_head itself), then gathered
        whole, so the sampler runs unsharded."""
        if self.mesh is None:
            return ()
        whole = replicated(self.mesh)
        if self.arch.vocab_size % self.tp:
            return (whole,)
        return (NamedSharding(self.mesh, PartitionSpec(None, MODEL_AXIS)), whole)

    def prepare(self, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The loader's flat weights with KV heads replicated when tp > num_kv_heads."""
        family = family_for(self.source_arch.architecture)
        return partition.replicate_kv_heads(weights, self.source_arch, self.tp,
                                            family.kv_head_weights)

    def place(self, params: Any) -> Any:
        """Host params → device arrays: one device, or each device only its own shard."""
        if self.mesh is None:
            return jax.device_put(params)
        family = family_for(self.arch.architecture)   # its partition rules
        params = partition.shard_params(params, self.mesh, family.param_spec_for(self.arch))
        total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
        logger.info("parameters: %.1f MiB in total, %.1f MiB on each device",
                    total / 2**20, partition.per_device_bytes(params) / 2**20)
        return params

    def weight_bytes_per_device(self, params: Any, total_bytes: int) -> int:
        return partition.per_device_bytes(params) if self.mesh is not None else total_bytes

    def shard_backend(self, backend: AttentionBackend) -> AttentionBackend:
        return partition.shard_backend(backend, self.mesh) if self.mesh is not None else backend

    def agree(self, plan: Any) -> Any:
        """Every process must build the same cache: take the smallest block count of all."""
        if jax.process_count() == 1:
            return plan
        from jax.experimental import multihost_utils

        counts = multihost_utils.process_allgather(np.array([plan.num_blocks], np.int64))
        fewest = int(np.min(counts))
        if fewest != plan.num_blocks:
            logger.info("KV cache: %d blocks here, %d on the smallest process; using %d",
                        plan.num_blocks, fewest, fewest)
            plan = dataclasses.replace(plan, num_blocks=fewest)
        return plan

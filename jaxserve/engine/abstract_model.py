"""A placed model without a byte of its weights: what `jaxserve compile` builds its runner
from (engine/aot_compile.py), the ShapeDtypeStructs loading and placing would produce.

    placed = place_abstract_model(config, platform, mesh, cache_dir)   # a PlacedModel

The params come from the model's config.json (the family's weight shapes, int8 applied as
shapes), placed by the same `ModelPlacement` rules, in the dtype startup would choose
(model_source.compute_dtype), on a mesh of the target's compile-only devices. With
pipeline_parallel_size > 1 they are one tree per stage (models/pipeline_stage.py's slices),
each on its stage's (1, tp) sub-mesh, as `PipelinePlacement.place` would leave them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.model_source import PlacedModel, compute_dtype
from jaxserve.models import partition
from jaxserve.models.pipeline_placement import PipelinePlacement
from jaxserve.models.pipeline_stage import stage_params
from jaxserve.models.registry import family_for, read_arch
from jaxserve.platforms import Platform
from jaxserve.quantization import check_mode
from jaxserve.quantization.int8 import quantize_params_int8


def abstract_params(family: Any, placement: Any, dtype: Any, quantization: str | None) -> Any:
    """The params tree as ShapeDtypeStructs with their shardings: what loading the
    checkpoint and placing it would produce, without a byte of it (a pipeline placement:
    a list of trees, one per stage)."""
    weights = {name: jax.ShapeDtypeStruct(shape, dtype)
               for name, shape in family.weight_shapes(placement.source_arch).items()}
    params = family.params_from_weights(placement.prepare(weights), placement.arch)
    if quantization == "int8":
        params = quantize_params_int8(params)
    if isinstance(placement, PipelinePlacement):
        tied = placement.arch.tie_word_embeddings
        return [_placed(family, stage, jax.eval_shape(
                    lambda p, layers=layers: stage_params(p, layers, tied), params))
                for stage, layers in zip(placement.stages, placement.layers)]
    return _placed(family, placement, params)


def _placed(family: Any, placement: Any, params: Any) -> Any:
    """params' ShapeDtypeStructs with the shardings `placement.place` would give them."""
    if placement.mesh is None:
        shardings = jax.tree.map(
            lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), params)
    else:
        specs = partition.param_specs(params, placement.tp, family.param_spec_for(placement.arch))
        shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(placement.mesh, s), specs,
                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        params, shardings)


def place_abstract_model(config: EngineConfig, platform: Platform, mesh: Any,
                         cache_dir: str | None) -> PlacedModel:
    """The model `config` names, placed on `mesh` (None: one device here) as ShapeDtypeStructs
    (`PlacedModel.source_format` "abstract"); packed GGUF tensors are refused (they are read
    from the file)."""
    from jaxserve.loader import read_model_config
    from jaxserve.loader.hub_download import hub_options
    from jaxserve.models.placement import ModelPlacement

    mc = config.model_config
    quantization = check_mode(mc.quantization)
    if quantization == "gguf":
        raise ValueError("jaxserve compile: quantization='gguf' keeps packed GGUF tensors read "
                         "from the file; use int8 or none")
    hf_config, model_path = read_model_config(mc.model, hub_options(mc))
    source_arch = read_arch(hf_config)
    family = family_for(source_arch.architecture)
    dtype, why = compute_dtype(config, platform, lambda: source_arch, cache_dir)
    placement = ModelPlacement.create(config.parallel_config, source_arch, mesh)
    params = abstract_params(family, placement, dtype, quantization)
    resident_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                         for x in jax.tree.leaves(params))
    return PlacedModel(arch=placement.arch, source_arch=source_arch, placement=placement,
                       params=params, resident_bytes=resident_bytes, dtype=dtype,
                       quantization=quantization, hf_config=hf_config, tokenizer=None,
                       generation_config={}, model_path=model_path, source_format="abstract",
                       dtype_reason=why)

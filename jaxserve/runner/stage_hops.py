"""Moving arrays between pipeline stages that run in different processes.

Across processes (`--num-processes N -pp P`) a stage's devices all sit in one process
(jaxserve/pipeline_layout.py), so a stage's output reaches the next stage's process with one
collective: a `shard_map` over the ``('stage', 'model')`` mesh of every stage's devices whose
body is `jax.lax.ppermute` from the sending stage's row of devices to the receiving one's
(device ``m`` of one stage to device ``m`` of the other). Each process supplies the blocks of
its own devices (`jax.make_array_from_single_device_arrays`): the sender its array on each of
its devices, every other device zeros of the same shape. The global array is the stages'
blocks concatenated on axis 0 (``[P * d0, ...]`` split on ``'stage'``), so a block is exactly
the array and nothing is reshaped. XLA carries it (gloo over TCP on CPU, NCCL on GPU); there
is no socket of ours.

Every process calls `send` for every hop, in the same order, with the same shapes (the
leader's step broadcast gives every process the same steps): a process that neither sends
nor receives still takes part in the collective.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.mesh import MODEL_AXIS, replicated

logger = logging.getLogger(__name__)

STAGE_AXIS = "stage"


class StageHops:
    """The hop collectives of one pipeline (see the module docstring): compiled per
    (source, destination, shapes), each process holding the zeros its devices send."""

    def __init__(self, stage_meshes: Sequence[Mesh]) -> None:
        """stage_meshes: every stage's (1, tp) mesh, in stage order."""
        self.stage_meshes = list(stage_meshes)
        grid = np.array([list(mesh.devices.flat) for mesh in self.stage_meshes], dtype=object)
        self.mesh = Mesh(grid, (STAGE_AXIS, MODEL_AXIS))
        self._split = NamedSharding(self.mesh, P(STAGE_AXIS))
        self._executables: dict[tuple, Any] = {}
        self._zeros: dict[tuple, jax.Array] = {}
        self._lock = threading.Lock()     # warm-up compiles buckets on several threads

    def _here(self, stage: int) -> bool:
        return all(d.process_index == jax.process_index()
                   for d in self.stage_meshes[stage].devices.flat)

    def _global_structs(self, specs: Sequence[Any]) -> tuple[jax.ShapeDtypeStruct, ...]:
        num_stages = len(self.stage_meshes)
        structs = []
        for spec in specs:
            if len(spec.shape) == 0:
                raise ValueError("a stage hop moves arrays of at least one dimension")
            shape = (num_stages * spec.shape[0], *spec.shape[1:])
            structs.append(jax.ShapeDtypeStruct(shape, spec.dtype, sharding=self._split))
        return tuple(structs)

    def compile(self, specs: Sequence[Any], source: int, destination: int) -> None:
        """Compile the hop of arrays shaped like ``specs`` (anything with .shape and .dtype)
        from stage ``source`` to stage ``destination`` (once; warm-up calls this for every
        bucket so that serving never compiles a hop)."""
        full = [specs[i] for i in _travelling(specs)]
        if full:
            self._compile(full, source, destination)

    def _compile(self, specs: Sequence[Any], source: int, destination: int) -> Any:
        key = (source, destination,
               tuple((tuple(s.shape), np.dtype(s.dtype).name) for s in specs))
        with self._lock:
            executable = self._executables.get(key)
        if executable is not None:
            return executable
        pairs = [(source, destination)]

        def hop(blocks):
            return tuple(jax.lax.ppermute(block, STAGE_AXIS, pairs) for block in blocks)

        fn = jax.jit(jax.shard_map(hop, mesh=self.mesh, in_specs=(P(STAGE_AXIS),),
                                   out_specs=P(STAGE_AXIS)))
        executable = fn.lower(self._global_structs(specs)).compile()
        with self._lock:
            self._executables[key] = executable
        return executable

    def _zeros_on(self, device: jax.Device, shape: tuple[int, ...], dtype: Any) -> jax.Array:
        """A device's block when it sends nothing (kept: hops are never donated)."""
        key = (device.id, shape, np.dtype(dtype).name)
        zeros = self._zeros.get(key)
        if zeros is None:
            zeros = self._zeros[key] = jax.device_put(np.zeros(shape, dtype), device)
        return zeros

    def send(self, arrays: Sequence[jax.Array] | None, specs: Sequence[Any], source: int,
             destination: int) -> list[jax.Array] | None:
        """Move ``arrays`` (on stage ``source``'s devices; read only in its process, any
        sharding on its mesh) to stage ``destination``. specs: their shapes and dtypes, the
        same in every process. Returns, in the destination's process, the arrays replicated
        on its mesh; None in every other process. Empty arrays (a step without logprob
        columns) do not travel: the destination makes its own."""
        full = _travelling(specs)
        moved = self._send([arrays[i] for i in full] if arrays is not None else None,
                           [specs[i] for i in full], source, destination) if full else []
        if not self._here(destination):
            return None
        whole = replicated(self.stage_meshes[destination])
        out = dict(zip(full, moved))
        return [out[i] if i in out else jax.device_put(np.zeros(spec.shape, spec.dtype), whole)
                for i, spec in enumerate(specs)]

    def _send(self, arrays: Sequence[jax.Array] | None, specs: Sequence[Any], source: int,
              destination: int) -> list[jax.Array] | None:
        executable = self._compile(specs, source, destination)
        sending = self._here(source)
        if sending:
            here = replicated(self.stage_meshes[source])
            arrays = [jax.device_put(array, here) for array in arrays]
        blocks = []
        for array, spec, struct in zip(arrays if sending else [None] * len(specs), specs,
                                       self._global_structs(specs)):
            shards = {} if array is None else {s.device: s.data for s in array.addressable_shards}
            local = [shards.get(device) if device in shards else
                     self._zeros_on(device, tuple(spec.shape), spec.dtype)
                     for device in self._split.addressable_devices]
            blocks.append(jax.make_array_from_single_device_arrays(struct.shape, self._split,
                                                                   local))
        moved = executable(tuple(blocks))
        if not self._here(destination):
            return None
        mesh = self.stage_meshes[destination]
        whole = replicated(mesh)
        out = []
        for leaf, spec in zip(moved, specs):
            shards = {s.device: s.data for s in leaf.addressable_shards}
            out.append(jax.make_array_from_single_device_arrays(
                tuple(spec.shape), whole, [shards[d] for d in mesh.devices.flat]))
        return out


def _travelling(specs: Sequence[Any]) -> list[int]:
    """The indices of the non-empty arrays (the ones a hop carries)."""
    return [i for i, spec in enumerate(specs) if int(np.prod(spec.shape)) > 0]

"""The device mesh: ``Mesh(('data', 'model'))`` of shape (data_parallel_size, tensor_parallel_size).

Row ``r`` of the mesh is data-parallel replica ``r``: its ``tensor_parallel_size``
devices hold one copy of the weights (sharded on ``model``) and one KV cache.
Each replica runs on its own sub-mesh (``replica_meshes``), a (1, tp) mesh with
the same axis names, so partition specs never mention ``data``.

    mesh = make_mesh(tensor_parallel_size=2, data_parallel_size=2)   # 4 devices
    replica_meshes(mesh)   # [Mesh(1x2: devices 0,1), Mesh(1x2: devices 2,3)]

On CPU, simulate devices with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(set before JAX starts).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

AXES = ("data", "model")
DATA_AXIS, MODEL_AXIS = AXES


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (dp, tp) mesh over the first dp * tp devices (all of them across processes).

    In a multi-process run the mesh must cover every device of every process (each
    process executes the same step on its own devices), so dp * tp must equal
    ``jax.device_count()``.
    """
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size and data_parallel_size must be >= 1, got "
                         f"{tp} and {dp}")
    needed = tp * dp
    devices = list(devices) if devices is not None else jax.devices()
    if jax.process_count() > 1 and needed != len(devices):
        raise ValueError(
            f"a multi-process run must use every device: tensor_parallel_size ({tp}) x "
            f"data_parallel_size ({dp}) = {needed}, but the {jax.process_count()} processes "
            f"have {len(devices)} devices together")
    if needed > len(devices):
        # The hint applies to the CPU (the only platform whose devices can be simulated);
        # it is given on every platform, as this leaf module asks no platform questions.
        hint = (" (on CPU, simulate devices with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={needed})")
        raise ValueError(f"tensor_parallel_size ({tp}) x data_parallel_size ({dp}) needs "
                         f"{needed} devices, but only {len(devices)} are visible{hint}")
    chosen = devices[:needed]
    try:   # topology-aware order on GPU/TPU (tp groups on fast links); plain order on CPU
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh((dp, tp), chosen)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.array(chosen, dtype=object).reshape(dp, tp)
    return Mesh(grid, AXES)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One (1, tp) sub-mesh per data-parallel replica, in replica order."""
    return [Mesh(mesh.devices[r:r + 1], AXES) for r in range(mesh.shape[DATA_AXIS])]


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of step inputs and small constants: a full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())


def put_replicated(tree: Any, sharding: NamedSharding | None) -> Any:
    """Host values → device arrays with `sharding` (None: the default device).

    Across processes every process passes the same values (the leader broadcast them),
    so arrays are assembled from local data with `make_array_from_callback`: a plain
    `device_put` onto devices of several processes first checks that the values agree
    everywhere, which is a collective per call. Leaves that are already jax Arrays are
    assumed placed.
    """
    if sharding is None or sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def put(value: Any) -> Any:
        if isinstance(value, jax.Array):
            return value
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, tree)


def describe(mesh: Mesh) -> str:
    """'2x4 mesh (data x model) of 8 cpu devices [0..7]' for the startup log."""
    ids = [d.id for d in mesh.devices.flat]
    span = f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else str(ids[0])
    return (f"{mesh.shape[DATA_AXIS]}x{mesh.shape[MODEL_AXIS]} mesh (data x model) of "
            f"{len(ids)} {mesh.devices.flat[0].platform} device(s) [{span}]")

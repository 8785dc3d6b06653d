"""Named GPUs to compile for without one: `jaxserve compile --target h200`.

A target is a `stream_executor.GpuTargetConfigProto` in text form, one file per GPU in
jaxserve/targets/ (what XLA knows of the device: compute capability, SMs, shared memory,
memory size). With the compile-only extras installed (`pip install 'jaxserve[gpu-compile]'`:
jax-cuda12-plugin, jax-cuda12-pjrt, nvidia-cuda-nvcc-cu12) and JAX_PLATFORMS=cpu, the CUDA
plugin turns a target into a *topology* of compile-only devices: `jax.jit(...).lower(...)`
against shardings on their mesh compiles real sm_90a executables (XLA fusions through
ptxas, the Pallas attention kernel through Triton, NCCL collectives for tp > 1) that
serialize and load on the real GPU.

Without a device there is no autotuning, so XLA's Triton GEMMs get its default tiles. They
are still what the step compiles with, as on a device: a cuBLAS GEMM needs its operand as a
buffer of its own, so with ``xla_gpu_enable_triton_gemm=false`` XLA copied every layer's
weight slices out of the stacked weights, every step, in every bucket (21 copies in a
3-layer 8B step; tests/test_gpu_compile.py) -- three passes over the weights where decode
needs one (the rolled scan's copies: 10.8 ms vs 3.8 ms per 8B step on an H200). Triton
GEMMs read the slices in place; what their untuned tiles cost against cuBLAS is measured
on a device by benchmarks/bench_layer_loop.py (unrolled-untuned vs unrolled-cublas).

The Pallas->Triton lowering assumes compute capability 9.0 when no GPU is present, so only
sm_90 targets (h100, h200) produce kernels tuned for their GPU; a100 compiles, with sm_90
assumptions in the kernel's lowering.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGETS_DIR = Path(__file__).resolve().parents[1] / "targets"
# What every GPU compile of the step passes to XLA. Dot merging off: XLA merges dots that
# share an input (q/k/v of a layer) into one by concatenating their weights -- a copy of
# those weights every step (48 MiB per layer of a Llama-3-8B; tests/test_gpu_compile.py).
#
# Rematerialization off: its memory tracker counts the KV cache twice. The cache is donated
# and aliased to the step's output (written in place), but each layer's write into the one
# K and one V array is a new buffer to the tracker, so it sees the cache among the step's
# temporaries as well as among its arguments. Against that phantom peak it fails ("Can't
# reduce memory use below ...") and meanwhile recomputes instructions, GEMMs included, into
# every step (4 recomputed GEMM fusions in a 2-layer Llama-3-8B decode step). The step's
# real temporaries (memory_analysis) are a few hundred MiB, planned for by runner/memory.py.
GPU_STEP_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0,
                             "xla_disable_hlo_passes": "rematerialization"}
# What ahead-of-time GPU compiles pass: the same (Triton GEMMs, untuned; module docstring).
GPU_COMPILER_OPTIONS = dict(GPU_STEP_COMPILER_OPTIONS)
# cuBLAS GEMMs instead: each copies its weight slice (a benchmark's control, not a default).
CUBLAS_COMPILER_OPTIONS = {**GPU_STEP_COMPILER_OPTIONS, "xla_gpu_enable_triton_gemm": False}


@dataclass(frozen=True)
class GpuTarget:
    name: str                       # the file's stem: h100, h200, a100
    text: str                       # the GpuTargetConfigProto text, as the plugin reads it
    device_kind: str                # what jax.Device.device_kind says on that GPU
    device_memory_bytes: int
    shared_memory_per_block_optin: int
    compute_capability: tuple[int, int]
    memory_bandwidth: int           # bytes / s

    @property
    def sm(self) -> str:
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"


def target_names() -> list[str]:
    return sorted(p.stem for p in TARGETS_DIR.glob("*.txtpb"))


def _field(text: str, name: str) -> str:
    match = re.search(rf"^\s*{name}:\s*(\S+)", text, re.MULTILINE)
    if match is None:
        raise ValueError(f"target config has no {name} field")
    return match.group(1).strip('"')


@functools.cache
def load_target(name: str) -> GpuTarget:
    path = TARGETS_DIR / f"{name}.txtpb"
    if not path.is_file():
        raise ValueError(f"unknown target {name!r}; choose one of {', '.join(target_names())}")
    text = path.read_text()
    kind = re.search(r'^device_description_str:\s*"([^"]+)"', text, re.MULTILINE)
    cc = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)\s*minor:\s*(\d+)", text)
    if kind is None or cc is None:
        raise ValueError(f"{path}: needs device_description_str and cuda_compute_capability")
    return GpuTarget(name=name, text=text, device_kind=kind.group(1),
                     device_memory_bytes=int(_field(text, "device_memory_size")),
                     shared_memory_per_block_optin=int(
                         _field(text, "shared_memory_per_block_optin")),
                     compute_capability=(int(cc.group(1)), int(cc.group(2))),
                     memory_bandwidth=int(_field(text, "memory_bandwidth")))


def topology_mesh(target: GpuTarget, num_devices: int) -> Any:
    """A (1, num_devices) ('data', 'model') mesh of compile-only devices of `target` (one
    host). Needs the CUDA plugin and JAX_PLATFORMS=cpu (else the plugin looks for a GPU)."""
    from jax.experimental import topologies

    from jaxserve.mesh import AXES

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target.text, topology=f"1x1x{num_devices}")
    except Exception as e:
        raise RuntimeError(
            f"cannot build a compile-only {target.name} topology ({type(e).__name__}: {e}); "
            "install the compile-only GPU extras (pip install 'jaxserve[gpu-compile]') and "
            "run with JAX_PLATFORMS=cpu") from e
    return topologies.make_mesh(topology, (1, num_devices), AXES)


def plugin_version() -> str | None:
    """The installed jax CUDA plugin's version (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version("jax-cuda12-plugin")
    except metadata.PackageNotFoundError:
        return None

"""The `Platform` interface: every rule that differs by the devices an engine runs on.

One object answers every platform question (vLLM's `vllm/platforms/interface.py`, tpu-inference's
`TpuPlatform`): it is resolved once -- for this host's devices (`current_platform`), for the
devices a set of parameters lives on (`platform_of_device`), or for a `jaxserve compile` target
(`platform_for_target`) -- and handed to the code that needs a decision. Nothing outside
`jaxserve/platforms/` compares platform names (tests/test_platform_rules.py greps for it).

The rules, and who asks them:
  resolve_config            the config's platform defaults, then a frozen tree (engine setup)
  auto_dtype                what dtype="auto" means where it is fixed (engine/compute_dtype.py)
  configure_process         process-wide settings before any trace (CPU: its matrix units)
  attention_backend         what "auto" means, and which backends may run here
  unroll_layers             the layer loop: unrolled (static per-layer slices) or a scan
  gemv_rows                 the matmul path's measured choice: decode rows on the CPU's GEMV
  memory_is_host_ram        memory pools: devices that share host RAM plan as one pool
  runs_gguf_block_kernels   the matmul path of a GGUF file: packed blocks or dequantized
  device_memory_bytes       a compile target's memory (None: ask the devices here)
  compile_mesh              a compile target's compile-only devices
  step_compiler_options     what every compile of the step passes to XLA
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.attention.backend import AttentionBackend
    from jaxserve.config import EngineConfig


class Platform(abc.ABC):
    """A kind of device an engine runs (or is compiled) on, and its rules."""

    #: jax's name for the platform ("cpu", "gpu" on a GPU host, "cuda" for a compile target,
    #: "tpu"): what `jax.export` and the startup log call it.
    name: str
    #: --max-num-batched-tokens when not given (vLLM's: a CPU step costs its tokens).
    default_max_num_batched_tokens: int = 2048
    #: Off the CPU the layers run unrolled: a scan over stacked layer weights copies each
    #: layer's slice every step (2.8x the weight-streaming time on an H200).
    unroll_layers: bool = True
    #: The devices' memory is host RAM (simulated CPU devices share one pool).
    memory_is_host_ram: bool = False
    #: A compile target's device memory (None: the devices here report their own).
    device_memory_bytes: int | None = None
    #: GGUF's packed blocks are read in place by this platform's kernels (kernels/cpu); where
    #: not, XLA would dequantize them every step, so a GGUF file is dequantized at load.
    runs_gguf_block_kernels: bool = False

    @property
    def auto_dtype(self) -> Any | None:
        """What dtype="auto" means here, where it is one dtype for every model; None where
        it depends on the machine and the model (the CPU: engine/compute_dtype.py's rule)."""
        return None

    def resolve_config(self, config: EngineConfig) -> EngineConfig:
        """The config with this platform's defaults filled in and its ranges checked: a new,
        read-only tree (the given one is left as it was)."""
        return config.resolved(default_max_num_batched_tokens=self.default_max_num_batched_tokens)

    def configure_process(self, config: EngineConfig) -> None:
        """Process-wide settings the platform's steps assume, before anything is traced."""

    @abc.abstractmethod
    def attention_backend_name(self, requested: str) -> str:
        """The concrete attention backend `requested` ("auto" included) means here; a
        backend that cannot run here is a ValueError naming the ones that can."""

    def attention_backend(self, requested: str) -> AttentionBackend:
        """The attention backend (unsharded) for `--attention-backend requested`."""
        from jaxserve.attention.backend import get_attention_backend

        return get_attention_backend(self.attention_backend_name(requested))

    def gemv_rows(self, setting: str | int, arch: Any, dtype: Any, reads_in_place: bool,
                  cache_dir: str | None) -> int:
        """Up to how many rows float projections take a streaming GEMV (0: never)."""
        return 0

    def compile_mesh(self, num_devices: int) -> Any:
        """The mesh of a compile target's devices (none here), None for the devices here."""
        return None

    def step_compiler_options(self) -> dict[str, Any] | None:
        """XLA options every compile of the step passes (None: XLA's defaults)."""
        return None

    def machine_identity(self) -> str:
        """What else an executable compiled here depends on (the CPU's flags for -march)."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

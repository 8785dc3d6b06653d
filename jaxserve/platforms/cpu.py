"""`CpuPlatform`: the host CPU (and its simulated devices) as an engine's platform."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.platforms.interface import Platform

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig

logger = logging.getLogger(__name__)


class CpuPlatform(Platform):
    """The CPU: a rolled layer scan over stacked weights read in place by the oneDNN matmul
    library (models/layer_matmul.py), the C++ attention kernel, dtype=auto by the CPU's kind
    or a timing, one RAM pool for all devices."""

    name = "cpu"
    # A CPU step's cost grows with its tokens: a smaller budget keeps decodes flowing
    # beside a prefill.
    default_max_num_batched_tokens = 512
    unroll_layers = False
    memory_is_host_ram = True
    runs_gguf_block_kernels = True

    def configure_process(self, config: EngineConfig) -> None:
        """What dtype=auto and the int8 path assume: the matrix units steps are traced for."""
        from jaxserve.kernels.cpu.matmul import detect_matrix_units, use_matrix_units

        setting = config.model_config.matrix_units
        wanted = use_matrix_units(setting)
        if setting != "auto":
            found = detect_matrix_units()
            if (wanted.bf16 and not found.bf16) or (wanted.int8 and not found.int8):
                logger.warning("matrix_units=%s on a CPU with %s: oneDNN emulates the missing "
                               "units (the same numbers, slower)", setting, found.describe())

    def attention_backend_name(self, requested: str) -> str:
        """auto: the C++ kernel when it builds here (else reference, with one warning)."""
        if requested == "auto":
            from jaxserve.attention.cpu import available  # warns once if it cannot build

            return "cpu" if available() else "reference"
        if requested == "pallas":
            raise ValueError("attention backend 'pallas' compiles Triton kernels for a GPU; "
                             "on cpu use 'auto' or 'reference' ('pallas-interpret' runs the "
                             "kernels in slow interpret mode, for tests)")
        return requested

    def gemv_rows(self, setting: str | int, arch: Any, dtype: Any, reads_in_place: bool,
                  cache_dir: str | None) -> int:
        """Up to how many rows float projections and a tied float LM head take the streaming
        GEMV (one device, weights read in place: kernels/cpu/gemv_choice.py), measured here
        once and stored beside the compilation cache; 0 where that path is not taken. A
        quantized model's projections do not use it (int8 streams at every decode row
        count), but its tied table is float: the same choice serves it."""
        if not reads_in_place:
            return 0
        if setting != "auto":
            logger.info("CPU projections (%s): streaming GEMV at <= %s rows (cpu_gemv_rows=%s)",
                        np.dtype(dtype).name, setting, setting)
            return int(setting)
        from jaxserve.kernels.cpu.gemv_choice import load_or_measure
        from jaxserve.kernels.cpu.timings import projection_shapes, worth_measuring

        shapes, num_layers = projection_shapes(arch), arch.num_layers
        if not worth_measuring(dtype, shapes, num_layers):
            return 0                 # cache-resident weights: nothing to stream, oneDNN
        start = time.perf_counter()
        try:
            choice, stored = load_or_measure(cache_dir, dtype, shapes, num_layers)
        except Exception as exc:     # a timing that cannot run must not stop the server
            logger.warning("could not time the CPU GEMV against oneDNN (%r): oneDNN at every "
                           "row count", exc)
            return 0
        logger.info("CPU projections (%s): %s [%s]", np.dtype(dtype).name,
                    choice.describe(), "stored choice" if stored else
                    f"{time.perf_counter() - start:.1f} s")
        return choice.rows

    def machine_identity(self) -> str:
        from jaxserve.kernels.cpu.build import cpu_identity

        return cpu_identity()

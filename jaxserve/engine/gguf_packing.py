"""What ``--quantization`` unset means for a GGUF file: served packed where that is faster.

A GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K tensors can stay packed (the file's own
blocks, 4.5-8.5 bits a weight) and be read in place by the CPU's block kernels
(kernels/cpu/gemv_gguf.h, as llama.cpp reads them), or be dequantized at load into --dtype.
On a CPU the packed blocks decode 2-3x faster than dequantized float32 and 1.5-2x faster than
bfloat16 (benchmarks/results/gguf-serving-cpu.md), at a measured accuracy cost the startup
log quotes (quantization/measured_cost.json: top-1 and KL against the float32-dequantized
model). Anywhere the kernels do not run, packed blocks would be dequantized by XLA inside
every step (10x slower than dequantized weights), so there the file is dequantized at load.

The rule (quantization unset, a .gguf file, weights read from it):
  packed        a CPU, one device, the CPU matmul library loads, dtype auto or bfloat16
  dequantized   another platform (the kernels are the CPU's), several devices (tensor /
                pipeline parallel: the block kernels read one device's layers), dtype
                float32 / float16 pinned by the user (the block kernels round activations to
                8 bits per block: asking for float32 is asking for float32 projections),
                executables compiled ahead of time (--aot-dir: `jaxserve compile` builds the
                dequantized model), or the file holds no packable tensor
``--quantization none`` always dequantizes; ``--quantization gguf`` always keeps them packed.

Packed by the rule, the packed tensors are also kept dequantized into --dtype beside the
blocks, when that copy takes at most half the memory available at start
(`float_copy_budget`): the block kernels win at decode rows (a dot product per weight row
and block, x rounded to 8 bits), oneDNN's float matmul on the copy above them (64 streams,
prefill chunks: benchmarks/results/gguf-serving-cpu.md), so each step takes the faster
(models/linear_method.GGUFPackedMethod). The copy costs what dequantized weights cost
(SmolLM2-135M: 257 MiB in bfloat16, 514 MiB in float32, beside 88 MiB of blocks); without
room for it the blocks serve every row count. ``--quantization gguf`` keeps the blocks alone.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxserve.platforms import Platform, platform_named

logger = logging.getLogger(__name__)


def gguf_default_quantization(config: Any, model_path: str, mesh: Any,
                              platform: Platform | str) -> tuple[str | None, str | None]:
    """(the quantization mode a model is loaded in, why -- None when the user chose it or
    the model is no GGUF file): ``"gguf"`` (packed) or None (dequantized) for a GGUF file
    with quantization unset, by the rule in this module's docstring. `platform`: an object,
    or its name (looked up)."""
    mc = config.model_config
    if mc.quantization is not None or not str(model_path).endswith(".gguf") \
            or mc.load_format != "auto":
        return mc.quantization, None
    platform = platform if isinstance(platform, Platform) else platform_named(platform)
    refused = _why_dequantized(config, mesh, platform)
    if refused is not None:
        return None, f"GGUF weights dequantized at load into --dtype: {refused}"
    return "gguf", ("GGUF weights kept packed (quantization unset: on this CPU the block "
                    "kernels decode faster than dequantized weights; --quantization none "
                    "dequantizes)")


def _why_dequantized(config: Any, mesh: Any, platform: Platform) -> str | None:
    mc = config.model_config
    if not platform.runs_gguf_block_kernels:
        return (f"the packed-block kernels are the CPU's (on {platform.name} XLA would dequantize "
                "them every step)")
    devices = getattr(mesh, "size", 1) if mesh is not None else 1
    pc = config.parallel_config
    if devices > 1 or pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        return "several devices (packed blocks are read in place by one device's kernels)"
    if mc.dtype in ("float32", "float", "float16", "half"):
        return (f"dtype={mc.dtype} asks for {mc.dtype} projections (the block kernels round "
                "activations to 8 bits per block; --quantization gguf keeps them packed)")
    if config.runner_config.aot_dir:
        return "--aot-dir: `jaxserve compile` builds the dequantized model"
    from jaxserve.kernels.cpu import matmul

    if not matmul.available():
        return "the CPU kernel library is not available here (pip install onednn-cpu-gomp " \
               "onednn-devel-cpu-gomp)"
    return None


def float_copy_budget(packed_by_default: bool) -> int:
    """Bytes the dequantized copy of a packed-by-default GGUF may take: half the memory
    available now (0: no copy)."""
    if not packed_by_default:
        return 0
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024 // 2
    except (OSError, KeyError, ValueError):
        return 0


def settle_packed(quantization: str | None, auto_packed: bool, weights: Any) -> str | None:
    """The mode the loaded weights are in: a file packed by the rule above that turned out to
    hold no packable tensor (all float16 / float32, or types no kernel reads) is plain."""
    from jaxserve.quantization.gguf_packed import PACKED_FORMATS

    if quantization == "gguf" and auto_packed \
            and not any(str(name).rsplit(".", 1)[-1] in PACKED_FORMATS for name in weights):
        return None
    return quantization

"""The machine a benchmark figure was measured on, recorded beside every figure in results/.

CPU figures depend on the CPU's kind (dtype=auto is bf16 where it has bf16 units, float32 on
AVX2-only CPUs), so each result names it: `kind` is amx, avx512_bf16 or avx2 (the best of the
flags it has), and `flags` lists the matrix-unit and vector flags found.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")


def cpu_info() -> dict:
    """The CPU's model name, core count, kind and matrix-unit flags (from /proc/cpuinfo)."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    found = [f for f in FLAGS if f in flags]
    kind = next((k for k, f in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"),
                                ("avx2", "avx2")) if f in flags), "other")
    return {"cpu": model, "cpus": os.cpu_count(), "cpu_kind": kind, "cpu_flags": found}


def machine_info() -> dict:
    """cpu_info plus the platform, Python and the load average when measured."""
    return {**cpu_info(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average": os.getloadavg()[0]}

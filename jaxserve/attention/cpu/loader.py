"""Compile the CPU attention kernel (paged_attention.cc) once and load it into XLA.

The build, its cache key and the file lock are the shared builder's
(`jaxserve.kernels.cpu.build`); this module names the attention library and registers its
FFI target. ``python -m jaxserve.attention.cpu.build`` builds it ahead of time (``make
setup`` does).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from jaxserve.kernels.cpu import build as kernel_build
from jaxserve.kernels.cpu.build import (
    CpuKernelBuildError,
    FfiTarget,
    KernelLibrary,
    find_compiler,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cc")
TARGET_NAME = "jaxserve_paged_attention"
HANDLER_SYMBOL = "JaxservePagedAttention"
_FALLBACK_HINT = ("--attention-backend reference (attention_backend='reference', pure JAX) "
                  "works without a compiler")

_warned = False

__all__ = ["CpuAttentionBuildError", "LIBRARY", "available", "build", "find_compiler",
           "register"]


class CpuAttentionBuildError(CpuKernelBuildError):
    """The C++ attention kernel could not be compiled or loaded."""


LIBRARY = KernelLibrary(name="paged_attention",
                        sources=(SOURCE, SOURCE.with_name("write_kv.cc"),
                                 SOURCE.with_name("attention_simd.h"),
                                 SOURCE.with_name("element_types.h"),
                                 kernel_build.HERE / "parallel_for.h",
                                 kernel_build.HERE / "bf16_bits.h"),
                        fallback_hint=_FALLBACK_HINT, error=CpuAttentionBuildError)
_FFI_TARGET = FfiTarget(TARGET_NAME, HANDLER_SYMBOL, lambda: LIBRARY, "the CPU attention kernel")
WRITE_KV_TARGET = "jaxserve_write_kv"
_WRITE_KV = FfiTarget(WRITE_KV_TARGET, "JaxserveWriteKV", lambda: LIBRARY,
                      "the CPU KV-cache write")


def build(force: bool = False) -> Path:
    """Path of the compiled kernel, compiling it first if this key has no library yet."""
    return kernel_build.build(LIBRARY, force=force)


def register() -> Path:
    """Build (if needed), load and register the FFI targets (attention, KV write) with XLA;
    idempotent."""
    _WRITE_KV.register()
    return _FFI_TARGET.register()


def available() -> bool:
    """True if the kernel builds and loads here; else logs one warning and returns False."""
    global _warned
    try:
        register()
        return True
    except CpuAttentionBuildError as e:
        if not _warned:
            _warned = True
            logger.warning("CPU attention kernel unavailable, using the reference attention: %s",
                           e)
        return False


def main(argv: list[str] | None = None) -> int:
    """Build the attention kernel and (when oneDNN is installed) the matmul library."""
    parser = argparse.ArgumentParser(description="Build the jaxserve CPU kernels.")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if one cannot be built (default: warn, exit 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from jaxserve.kernels.cpu import matmul

    failed = False
    for name, make in (("CPU attention kernel", lambda: build(force=args.force)),
                       ("CPU matmul library", lambda: kernel_build.build(matmul.library(),
                                                                         force=args.force))):
        try:
            print(f"{name}: {make()}")
        except CpuKernelBuildError as e:
            print(f"warning: {e}", file=sys.stderr)
            failed = True
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())

"""Keep glibc from returning XLA:CPU's per-step temporaries to the OS.

XLA:CPU allocates a step's large temporaries with malloc on every call. Above
glibc's mmap threshold each one is a fresh mmap whose pages fault in again on
first touch, every step, costing more than the sampling pass itself
(benchmarks/bench_host.py). Raising the mmap and trim thresholds keeps those
pages in the heap, reused across steps. Process-wide and harmless elsewhere, but
only done for the CPU platform, where the engine's device memory is host memory.
"""

from __future__ import annotations

import ctypes
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LIMIT = 2**31 - 1
_done = False


def keep_freed_memory_in_heap() -> bool:
    """Raise glibc's mmap/trim thresholds once per process. Returns True if applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _LIMIT) == 1 and \
            libc.mallopt(_M_TRIM_THRESHOLD, _LIMIT) == 1
    except (OSError, AttributeError):   # not glibc (musl, ...)
        return False
    _done = ok
    logger.debug("glibc mallopt thresholds raised: %s", ok)
    return ok

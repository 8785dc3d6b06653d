"""Run a Python module (the server) with a memory probe thread: where does RSS go?

    python benchmarks/memory_probe.py OUT.jsonl INTERVAL_S -m jaxserve.entrypoints.cli serve ...

Every INTERVAL_S seconds one JSON line is appended to OUT.jsonl with:
- ``rss_mib``: the process's resident set (what the soak's flatness target is about);
- glibc's ``mallinfo2`` (all arenas): ``malloc_in_use_mib`` (allocated, not freed),
  ``malloc_free_mib`` (freed but kept in the heap: jaxserve/runner/host_malloc.py raises
  the trim threshold on purpose) and ``mmap_mib`` (large blocks mapped directly);
- ``python_traced_mib``: Python-object memory tracemalloc sees (1 frame), minus nothing:
  ``tracemalloc_overhead_mib`` is reported beside it;
- ``gc_objects`` and the 15 types whose object counts changed most since the previous line,
  plus tracemalloc's 10 largest growths by source line since the previous line.

A true leak shows as ``malloc_in_use`` (native) or ``python_traced`` (Python) growing round
after round of the same traffic; an allocator high-water mark as ``malloc_free`` absorbing
the growth while ``in_use`` stays flat. A diagnostic tool (tracemalloc slows the server),
not a benchmark.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import runpy
import sys
import threading
import time
import tracemalloc
from pathlib import Path


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo() -> dict[str, float]:
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):      # not glibc >= 2.33
        return {}
    fn.restype = _MallInfo2
    info = fn()
    mib = 1 / 2**20
    return {"malloc_in_use_mib": round((info.uordblks + info.hblkhd) * mib, 1),
            "malloc_free_mib": round(info.fordblks * mib, 1),
            "mmap_mib": round(info.hblkhd * mib, 1), "arena_mib": round(info.arena * mib, 1)}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _probe(out: Path, interval: float) -> None:
    previous_types: collections.Counter[str] = collections.Counter()
    previous_snapshot = None
    start = time.monotonic()
    while True:
        time.sleep(interval)
        counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
        type_growth = (counts - previous_types) if previous_types else collections.Counter()
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)])
        line_growth = []
        if previous_snapshot is not None:
            for stat in snapshot.compare_to(previous_snapshot, "lineno")[:10]:
                frame = stat.traceback[0]
                line_growth.append([f"{frame.filename}:{frame.lineno}",
                                    round(stat.size_diff / 2**20, 3), stat.count_diff])
        record = {"t": round(time.monotonic() - start, 1), "rss_mib": _rss_mib(), **_mallinfo(),
                  "python_traced_mib": round(tracemalloc.get_traced_memory()[0] / 2**20, 1),
                  "tracemalloc_overhead_mib": round(tracemalloc.get_tracemalloc_memory() / 2**20,
                                                    1),
                  "gc_objects": sum(counts.values()),
                  "type_growth": type_growth.most_common(15), "line_growth": line_growth}
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        previous_types, previous_snapshot = counts, snapshot
        del counts, snapshot


def main() -> None:
    out, interval = Path(sys.argv[1]), float(sys.argv[2])
    if sys.argv[3] != "-m":
        raise SystemExit(__doc__)
    module, sys.argv = sys.argv[4], [sys.argv[4], *sys.argv[5:]]
    out.write_text("")
    tracemalloc.start(1)
    threading.Thread(target=_probe, args=(out, interval), daemon=True,
                     name="memory-probe").start()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

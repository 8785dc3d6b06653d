"""Where a served benchmark's CPU time went: the server's threads by name, and the client.

On a 2-core box the server's compute threads, its HTTP loop, the benchmark client and
anything else running share the same cores, so a served figure means little without
knowing who had the CPU. `ProcessGroupCpu` reads the per-thread CPU time of every process
in a process group from /proc (Linux) before and after a run; `cpu_split` turns the
difference into seconds per thread name (``tf_XLAEigen`` is XLA's intra-op pool,
``python`` the interpreter's threads: jaxserve's engine thread and asyncio loop) plus the
share of the box the server got (``server_cores``: its CPU seconds over the wall time). A
server that got well under the box's cores while the run lasted was sharing them with
something else, and its figure is not a quiet-box figure.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

_PROC = Path("/proc")


def _thread_cpu(pid: int) -> dict[str, float]:
    """thread id:name -> CPU seconds (user + system) of one process's threads; {} if gone."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir(_PROC / str(pid) / "task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = (_PROC / str(pid) / "task" / tid / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{pid}/{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _group_pids(pgid: int) -> list[int]:
    """Every process whose process group is `pgid`."""
    pids = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
            pids.append(int(entry.name))
    return pids


class ProcessGroupCpu:
    """CPU seconds per thread of a process group (a server started with
    start_new_session=True: its pid is the group id), read when asked."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid

    def read(self) -> dict[str, float]:
        """thread key -> CPU seconds, every thread of every process in the group."""
        out: dict[str, float] = {}
        for pid in _group_pids(self.pgid):
            out.update(_thread_cpu(pid))
        return out


def cpu_split(before: dict[str, float], after: dict[str, float], wall_s: float,
              client_cpu_s: float | None = None) -> dict:
    """CPU seconds spent between two readings, by thread name, and the server's share."""
    by_name: collections.Counter[str] = collections.Counter()
    for key, seconds in after.items():
        by_name[key.split(":", 1)[1]] += seconds - before.get(key, 0.0)
    total = sum(by_name.values())
    split = {"wall_s": round(wall_s, 2), "server_cpu_s": round(total, 2),
             "server_cores": round(total / wall_s, 2) if wall_s > 0 else 0.0,
             "by_thread_name": {name: round(s, 2) for name, s in by_name.most_common(8)
                                if s >= 0.01},
             "cpus": os.cpu_count()}
    if client_cpu_s is not None:
        split["client_cpu_s"] = round(client_cpu_s, 2)
    return split

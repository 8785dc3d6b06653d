"""Serialized step executables on disk, keyed by everything that shapes them: warm restarts
skip tracing and lowering, not just XLA compilation.

JAX's persistent compilation cache saves the compile, but each start still traces and lowers
every bucket's step to find its cache key: about 1.2 s per bucket for SmolLM2 on this CPU box,
against 0.3 s to load a serialized executable (benchmarks/results/startup-cpu.json). Here the
key is computed without tracing, from:

* the jax / jaxlib versions, the platform, the devices (ids and kinds) and XLA_FLAGS;
* on CPU, the host CPU's model and features: XLA:CPU compiles for the CPU it runs on, so an
  executable stored on one machine (a container image's build host) is a miss on another;
* the content of every source file of the jaxserve package (any code change is a miss);
* the runner's settings (architecture, dtypes, cache shape, buckets, logprobs, speculative
  rows, shardings) and the params tree's shapes, dtypes and shardings;

so a change in any of them misses the cache and compiles as before. Files are written
atomically (temp file + rename): a concurrent or killed writer never leaves a torn entry.
A file that fails to load is treated as a miss and recompiled.

Only executables compiled in this process are stored, never one read back from JAX's
persistent cache: an XLA:CPU executable that came from that cache serializes without its
kernels, and loading the copy fails at its first call ("Function wrapped_slice.3 not
found"; seen with jax 0.10.2). Such a step is served as it came, and noted (`unstored`):
after warm-up the runner compiles it once more around JAX's cache, in the background, and
stores that (runner/step_compilation.py). Without this, a code change that leaves the step's
HLO unchanged (a new key here, a hit in JAX's cache) would leave this store empty for good
and every later start compiling.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

# Threads whose latest compile was served by JAX's persistent cache (JAX records the event
# in the compiling thread).
_JAX_CACHE_HIT_THREADS: set[int] = set()


def _record_jax_cache_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _JAX_CACHE_HIT_THREADS.add(threading.get_ident())


jax.monitoring.register_event_listener(_record_jax_cache_hit)

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]        # jaxserve/
_SOURCE_SUFFIXES = (".py", ".cc", ".cpp", ".h", ".json")


@functools.cache
def source_fingerprint() -> str:
    """A hash of every jaxserve source file (path and content)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE_ROOT.rglob("*") if p.suffix in _SOURCE_SUFFIXES
                       and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(_PACKAGE_ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _aval_description(tree: Any) -> list[str]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    described = [str(treedef)]
    for path, leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        described.append(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}:{sharding}:"
                         f"{getattr(leaf, 'committed', None)}")
    return described


def _schedulable_cpus() -> int:
    """CPUs this process may run on: XLA's intra-op pool size, and the column ranges weights
    packed for oneDNN are cut into (kernels/cpu/packed_matmul.packing_parts), which a step
    names in its calls."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def executable_key(settings: dict[str, Any], params: Any) -> str:
    import jaxlib

    from jaxserve.platforms import current_platform

    host = current_platform()
    devices = [f"{d.platform}:{d.id}:{d.device_kind}" for d in jax.devices()]
    parts = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
             "backend": host.name, "devices": devices, "cpu": host.machine_identity(),
             "cpus": _schedulable_cpus(),   # packed weights' column ranges follow it
             "xla_flags": os.environ.get("XLA_FLAGS", ""), "source": source_fingerprint(),
             "settings": {k: repr(v) for k, v in sorted(settings.items())},
             "params": _aval_description(params)}
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


class ExecutableCache:
    """Per-bucket serialized executables under ``directory/<key>/``."""

    def __init__(self, directory: str | os.PathLike, key: str) -> None:
        self.directory = Path(directory) / key
        self.hits = 0
        self.misses = 0
        # Buckets JAX's persistent cache served this start: stored after a compile around it.
        self.unstored: set[tuple[int, int]] = set()
        self.refilled = 0           # of those, stored since

    @contextlib.contextmanager
    def compiling(self) -> Iterator[Callable[[], bool]]:
        """Around one compile in this thread; yields whether that compile was a hit in JAX's
        persistent cache (then its executable must not be stored, see above)."""
        thread = threading.get_ident()
        _JAX_CACHE_HIT_THREADS.discard(thread)
        yield lambda: thread in _JAX_CACHE_HIT_THREADS

    def _path(self, shape: tuple[int, int]) -> Path:
        return self.directory / f"step-{shape[0]}x{shape[1]}.bin"

    def load(self, shape: tuple[int, int]) -> Any | None:
        from jax.experimental import serialize_executable

        path = self._path(shape)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            return None
        try:
            serialized, in_tree, out_tree, device_ids = pickle.loads(data)
            # The devices it was compiled for, in its order (not every device of the host).
            by_id = {d.id: d for d in jax.devices()}
            executable = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree,
                execution_devices=[by_id[i] for i in device_ids])
        except Exception as e:   # a stale or foreign entry: recompile, never fail the start
            logger.warning("ignoring unreadable executable %s (%s: %s)", path,
                           type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return executable

    def store_compiled(self, shape: tuple[int, int], executable: Any,
                       from_jax_cache: bool) -> None:
        """Store an executable compiled in this process; one JAX's persistent cache served
        (see `compiling`) is noted in `unstored` instead."""
        if from_jax_cache:
            self.unstored.add(shape)
        else:
            self.store(shape, executable)

    def store(self, shape: tuple[int, int], executable: Any) -> None:
        from jax.experimental import serialize_executable

        try:
            device_ids = [d.id for d in executable._executable.xla_executable.local_devices()]
            data = pickle.dumps((*serialize_executable.serialize(executable), device_ids))
        except Exception as e:    # e.g. executables with constant args: keep serving
            logger.info("step %s cannot be serialized (%s: %s); not cached", shape,
                        type(e).__name__, e)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(shape))

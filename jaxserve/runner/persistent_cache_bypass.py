"""Compiling in one thread without JAX's persistent compilation cache: the compile neither
reads it nor writes it, and every other thread keeps using it.

An XLA:CPU executable that JAX's persistent cache hands back serializes without its kernels
(loading the copy fails at its first call, "Function wrapped_slice.3 not found", jax
0.10.2), so an executable meant to be serialized (runner/executable_cache.py, `jaxserve
compile`) must come from a real compile. JAX offers no per-compile switch: it decides once
per process whether the cache is in use (`jax_enable_compilation_cache` set later is
ignored until the global `compilation_cache.reset_cache()`). Two of its per-call seams do
it per thread instead:

* the cache key hashes `jax._src.cache_key.custom_hook()`: in a bypassing thread it adds a
  fresh random salt, so the lookup misses; elsewhere it returns what it returned before
  (the key is unchanged);
* `jax_persistent_cache_min_compile_time_secs`, set to infinity as a thread-local config
  context, keeps the result out of the cache (the salted key is never written, nor found).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator

_local = threading.local()
_install_lock = threading.Lock()
_installed = False


def _install_hook() -> bool:
    """Wrap JAX's cache-key hook once per process; False where this jax has no such seam."""
    global _installed
    with _install_lock:
        if _installed:
            return True
        try:
            from jax._src import cache_key
            from jax._src import config as jax_config
        except ImportError:
            return False
        previous = getattr(cache_key, "custom_hook", None)
        if previous is None or \
                not hasattr(jax_config, "persistent_cache_min_compile_time_secs"):
            return False

        def salted_hook() -> str:
            return previous() + getattr(_local, "salt", "")

        cache_key.custom_hook = salted_hook
        _installed = True
        return True


def available() -> bool:
    """Whether this jax lets a thread compile around its persistent cache."""
    return _install_hook()


@contextlib.contextmanager
def bypassing_persistent_cache() -> Iterator[bool]:
    """Compiles in this thread, inside the block, skip JAX's persistent compilation cache
    (neither read nor written). Yields False, changing nothing, where this jax has no seam
    for it (a caller that must not store a served executable checks
    `executable_cache.ExecutableCache.compiling` too)."""
    if not _install_hook():
        yield False
        return
    from jax._src import config as jax_config

    before = getattr(_local, "salt", "")
    _local.salt = os.urandom(16).hex()
    try:
        with jax_config.persistent_cache_min_compile_time_secs(math.inf):
            yield True
    finally:
        _local.salt = before

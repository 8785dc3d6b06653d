"""Compile the CPU kernels (paged_attention.cc, layer_matmul.cc) once and load them into XLA.

The shared library is cached under ``$JAXSERVE_FFI_CACHE`` (default
``~/.cache/jaxserve/ffi/``; a temp directory if that is not writable), keyed by a
hash of the sources (``SOURCES``: both .cc files and their shared header), the
compiler and its flags, the jax version and the host CPU (the build is ``-march=native``, hence the CPU in the key; if that does not compile, a
portable build is tried). A file lock keeps two processes from building the same key at
once. The cache location is a build-environment setting, like ``CXX``, not an engine
option: it changes where the file lives, never what the engine does. ``python -m jaxserve.attention.cpu.build`` builds it ahead of
time (``make setup`` does).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cc")
# Everything the library is built from: compiled (.cc) or included (.h); all are hashed
# into the cache key.
SOURCES = (SOURCE, Path(__file__).with_name("layer_matmul.cc"),
           Path(__file__).with_name("parallel_for.h"))
TARGET_NAME = "jaxserve_paged_attention"
HANDLER_SYMBOL = "JaxservePagedAttention"
# The library's second kernel (layer_matmul.cc, used by models/layer_matmul.py): one layer of
# stacked weights, in place.
LAYER_MATMUL_TARGET = "jaxserve_layer_matmul"
LAYER_MATMUL_SYMBOL = "JaxserveLayerMatmul"
# The third: a few rows' logits against a tied embedding table (models/layer_matmul.py).
SMALL_LOGITS_TARGET = "jaxserve_small_logits"
SMALL_LOGITS_SYMBOL = "JaxserveSmallLogits"
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno",
              "-ffp-contract=fast")
NATIVE_FLAGS = ("-march=native",)
_FALLBACK_HINT = ("--attention-backend reference (attention_backend='reference', pure JAX) "
                  "works without a compiler")

_lock = threading.Lock()
_registered: Path | None = None
_failure: CpuAttentionBuildError | None = None
_warned = False


class CpuAttentionBuildError(RuntimeError):
    """The C++ attention kernel could not be compiled or loaded."""


def find_compiler() -> str | None:
    """$CXX if set, else the first of g++, c++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dir() -> Path:
    """Where built libraries live: $JAXSERVE_FFI_CACHE, ~/.cache/jaxserve/ffi, or a temp dir."""
    candidates = []
    if os.environ.get("JAXSERVE_FFI_CACHE"):
        candidates.append(Path(os.environ["JAXSERVE_FFI_CACHE"]).expanduser())
    candidates.append(Path.home() / ".cache" / "jaxserve" / "ffi")
    candidates.append(Path(tempfile.gettempdir()) / f"jaxserve-ffi-{os.getuid()}")
    for directory in candidates:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(directory, os.W_OK):
            return directory
    raise CpuAttentionBuildError(
        f"no writable cache directory for the CPU attention kernel (tried "
        f"{', '.join(map(str, candidates))}); set JAXSERVE_FFI_CACHE. {_FALLBACK_HINT}")


def _cpu_identity() -> str:
    """The host CPU's model and feature flags: -march=native output is only valid there."""
    parts = [platform.machine()]
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("model name", "flags", "Features", "CPU part") and line not in parts:
                parts.append(line)
            if len(parts) >= 3 and key in ("flags", "Features"):
                break
    return "\n".join(parts)


def _compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise CpuAttentionBuildError(
            f"C++ compiler {compiler!r} does not run ({e}); the CPU attention kernel needs "
            f"g++ or clang++ (set CXX). {_FALLBACK_HINT}") from e
    return result.stdout.strip()


def flag_sets() -> list[tuple[str, ...]]:
    """Flags to try in order: tuned for this CPU, then portable."""
    return [BASE_FLAGS + NATIVE_FLAGS, BASE_FLAGS]


def library_path(compiler: str) -> Path:
    import jax

    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in SOURCES), compiler.encode(),
                 _compiler_version(compiler).encode(), " ".join(flag_sets()[0]).encode(), jax.__version__.encode(),
                 _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"paged_attention-{digest.hexdigest()[:20]}.so"


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(compiler: str, flags: tuple[str, ...], output: Path) -> subprocess.CompletedProcess:
    import jax

    compiled = [str(path) for path in SOURCES if path.suffix == ".cc"]
    cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", *compiled, "-o", str(output)]
    logger.debug("compiling: %s", " ".join(cmd))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def build(force: bool = False) -> Path:
    """Path of the compiled kernel, compiling it first if this key has no library yet."""
    missing = [path for path in SOURCES if not path.exists()]
    if missing:
        raise CpuAttentionBuildError(f"kernel source {missing[0]} is missing (a broken install?). "
                                     f"{_FALLBACK_HINT}")
    compiler = find_compiler()
    if compiler is None:
        raise CpuAttentionBuildError(
            "no C++ compiler found (looked for $CXX, g++, c++, clang++): the CPU attention "
            f"backend compiles a small C++ kernel on first use. Install g++; "
            f"{_FALLBACK_HINT}")
    lib = library_path(compiler)
    if lib.exists() and not force:
        return lib
    with _file_lock(lib.with_suffix(".lock")):
        if lib.exists() and not force:
            return lib  # another process built it while we waited
        tmp = lib.with_name(f"{lib.stem}.{os.getpid()}.tmp.so")
        errors = []
        try:
            for flags in flag_sets():
                try:
                    result = _compile(compiler, flags, tmp)
                except (OSError, subprocess.SubprocessError) as e:
                    errors.append(f"{' '.join(flags)}: {e}")
                    continue
                if result.returncode == 0:
                    if flags == BASE_FLAGS and NATIVE_FLAGS[0] in flag_sets()[0]:
                        logger.warning("CPU attention kernel: -march=native failed; built a "
                                       "portable (slower) kernel")
                    os.replace(tmp, lib)
                    logger.info("built CPU attention kernel %s", lib)
                    return lib
                errors.append(f"{' '.join(flags)}:\n{result.stderr.strip()[-2000:]}")
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    raise CpuAttentionBuildError(
        f"compiling the CPU attention kernel with {compiler} failed. {_FALLBACK_HINT}.\n"
        + "\n".join(errors))


def register() -> Path:
    """Build (if needed), load and register the FFI target with XLA; idempotent."""
    global _registered, _failure
    with _lock:
        if _registered is not None:
            return _registered
        if _failure is not None:
            raise _failure
        try:
            import jax

            lib = build()
            try:
                handle = ctypes.CDLL(str(lib))
                symbols = {TARGET_NAME: getattr(handle, HANDLER_SYMBOL),
                           LAYER_MATMUL_TARGET: getattr(handle, LAYER_MATMUL_SYMBOL),
                           SMALL_LOGITS_TARGET: getattr(handle, SMALL_LOGITS_SYMBOL)}
            except (OSError, AttributeError) as e:
                raise CpuAttentionBuildError(
                    f"loading the CPU attention kernel {lib} failed ({e}); delete it to rebuild. "
                    f"{_FALLBACK_HINT}") from e
            for target, symbol in symbols.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
        except CpuAttentionBuildError as e:
            _failure = e
            raise
        _registered = lib
        return lib


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
    parser = argparse.ArgumentParser(description="Build the jaxserve CPU attention kernel.")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if it cannot be built (default: warn, exit 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        lib = build(force=args.force)
    except CpuAttentionBuildError as e:
        print(f"warning: {e}", file=sys.stderr)
        return 1 if args.strict else 0
    print(f"CPU attention kernel: {lib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

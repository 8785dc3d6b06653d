"""Compile a C++ FFI library once, cache it, and load it: what every CPU kernel library of
jaxserve (the paged attention, the oneDNN matmul) shares.

A library is cached under ``$JAXSERVE_FFI_CACHE`` (default ``~/.cache/jaxserve/ffi/``; a
temp directory if that is not writable) as ``<name>-<build key>-<compiler key>.so``: the build
key hashes its sources (every .cc compiled and .h included), the flags, the jax version and
the host CPU (the build is ``-march=native``, hence the CPU in the key; if that does not
compile, a portable build is tried); the compiler key hashes the compiler and its version.
A library found in any of those directories (a read-only one too) is used as is. Where no
compiler is installed (a container image, whose build stage compiled the libraries), a
library with this build key made by any compiler is used: one built for this CPU loads, one
built elsewhere does not match. A file lock keeps two processes from building the same key
at once. The cache location is a build-environment setting, like ``CXX``: it changes where
the file lives, never what the engine does.

The code builds with g++ and clang++ alike (tests/test_kernel_build.py compiles every
library with both where both are installed).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno",
              "-ffp-contract=fast")
NATIVE_FLAGS = ("-march=native",)


class CpuKernelBuildError(RuntimeError):
    """A C++ kernel library could not be compiled or loaded."""


@dataclass(frozen=True)
class KernelLibrary:
    """One shared library: its name (the cache file's prefix), what it is built from, the
    extra flags (include dirs, libraries to link) and what to tell a user when it fails."""
    name: str
    sources: tuple[Path, ...]              # .cc compiled, .h hashed into the key
    include_dirs: tuple[Path, ...] = (HERE,)
    link_flags: tuple[str, ...] = ()
    fallback_hint: str = ""
    error: type[CpuKernelBuildError] = CpuKernelBuildError
    extra_key: tuple[str, ...] = field(default=())


def find_compiler() -> str | None:
    """$CXX if set, else the first of g++, c++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def candidate_dirs() -> list[Path]:
    """Where built libraries are looked for, in order: $JAXSERVE_FFI_CACHE,
    ~/.cache/jaxserve/ffi, a per-user temp dir."""
    candidates = []
    if os.environ.get("JAXSERVE_FFI_CACHE"):
        candidates.append(Path(os.environ["JAXSERVE_FFI_CACHE"]).expanduser())
    candidates.append(Path.home() / ".cache" / "jaxserve" / "ffi")
    candidates.append(Path(tempfile.gettempdir()) / f"jaxserve-ffi-{os.getuid()}")
    return candidates


def cache_dir(lib: KernelLibrary) -> Path:
    """Where a library is built: the first writable of `candidate_dirs`."""
    candidates = candidate_dirs()
    for directory in candidates:
        with contextlib.suppress(OSError):
            directory.mkdir(parents=True, exist_ok=True)
            if os.access(directory, os.W_OK):
                return directory
    raise lib.error(f"no writable cache directory for the CPU kernels (tried "
                    f"{', '.join(map(str, candidates))}); set JAXSERVE_FFI_CACHE. "
                    f"{lib.fallback_hint}")


def cpu_identity() -> str:
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


def compiler_version(compiler: str, lib: KernelLibrary) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise lib.error(f"C++ compiler {compiler!r} does not run ({e}); the CPU kernels need "
                        f"g++ or clang++ (set CXX). {lib.fallback_hint}") from e
    return result.stdout.strip()


def flag_sets() -> list[tuple[str, ...]]:
    """Flags to try in order: tuned for this CPU, then portable."""
    return [BASE_FLAGS + NATIVE_FLAGS, BASE_FLAGS]


def _digest(parts: tuple[bytes, ...], length: int) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:length]


def build_key(lib: KernelLibrary) -> str:
    """What the library's code depends on, the compiler aside: sources, flags, jax, the CPU."""
    import jax

    return _digest((*(path.read_bytes() for path in lib.sources),
                    " ".join(flag_sets()[0]).encode(), " ".join(lib.link_flags).encode(),
                    *(k.encode() for k in lib.extra_key), jax.__version__.encode(),
                    cpu_identity().encode()), 20)


def library_name(lib: KernelLibrary, compiler: str) -> str:
    """The file name of `lib` built by `compiler` on this machine."""
    compiler_key = _digest((compiler.encode(), compiler_version(compiler, lib).encode()), 8)
    return f"{lib.name}-{build_key(lib)}-{compiler_key}.so"


def library_path(lib: KernelLibrary, compiler: str) -> Path:
    """Where `compiler` builds `lib`: in the writable cache directory."""
    return cache_dir(lib) / library_name(lib, compiler)


def find_built(lib: KernelLibrary, compiler: str | None) -> Path | None:
    """A library already built for this machine in any candidate directory: by `compiler`,
    or (compiler None: none is installed) by whichever compiler built one."""
    pattern = library_name(lib, compiler) if compiler else f"{lib.name}-{build_key(lib)}-*.so"
    for directory in candidate_dirs():
        for path in sorted(directory.glob(pattern)) if directory.is_dir() else ():
            if ".tmp." not in path.name:
                return path
    return None


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compile_command(lib: KernelLibrary, compiler: str, flags: tuple[str, ...],
                    output: Path) -> list[str]:
    import jax

    compiled = [str(path) for path in lib.sources if path.suffix == ".cc"]
    includes = [f"-I{d}" for d in (*lib.include_dirs, jax.ffi.include_dir())]
    return [compiler, *flags, *includes, *compiled, "-o", str(output), *lib.link_flags]


def build(lib: KernelLibrary, force: bool = False, compiler: str | None = None) -> Path:
    """Path of the compiled library, compiling it first if this key has none yet."""
    missing = [path for path in lib.sources if not path.exists()]
    if missing:
        raise lib.error(f"kernel source {missing[0]} is missing (a broken install?). "
                        f"{lib.fallback_hint}")
    compiler = compiler or find_compiler()
    if compiler is None:
        built = None if force else find_built(lib, None)
        if built is not None:
            return built
        raise lib.error("no C++ compiler found (looked for $CXX, g++, c++, clang++) and no "
                        f"{lib.name} library built for this CPU in "
                        f"{', '.join(map(str, candidate_dirs()))}: the CPU kernels are compiled "
                        f"on first use. Install g++; {lib.fallback_hint}")
    built = None if force else find_built(lib, compiler)
    if built is not None:
        return built
    path = library_path(lib, compiler)
    with _file_lock(path.with_suffix(".lock")):
        if path.exists() and not force:
            return path  # another process built it while we waited
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.so")
        errors = []
        try:
            for flags in flag_sets():
                cmd = compile_command(lib, compiler, flags, tmp)
                logger.debug("compiling: %s", " ".join(cmd))
                try:
                    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                except (OSError, subprocess.SubprocessError) as e:
                    errors.append(f"{' '.join(flags)}: {e}")
                    continue
                if result.returncode == 0:
                    if flags != flag_sets()[0]:
                        logger.warning("%s: -march=native failed; built a portable (slower) "
                                       "library", lib.name)
                    os.replace(tmp, path)
                    logger.info("built CPU kernel library %s", path)
                    return path
                errors.append(f"{' '.join(flags)}:\n{result.stderr.strip()[-2000:]}")
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    raise lib.error(f"compiling {lib.name} with {compiler} failed. {lib.fallback_hint}\n"
                    + "\n".join(errors))


class FfiTarget:
    """A library's XLA FFI handler, registered at most once per process: the library built
    (if its key has none yet), loaded, and `symbol` registered as `target` on CPU (with the
    library's other handlers, ``more``: (target, symbol) pairs). A failure is remembered and
    raised again, so a machine without a compiler pays one attempt."""

    def __init__(self, target: str, symbol: str, library: Callable[[], KernelLibrary],
                 what: str, more: tuple[tuple[str, str], ...] = ()) -> None:
        self.target, self.symbol, self.library, self.what = target, symbol, library, what
        self.handlers = ((target, symbol),) + tuple(more)
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._failure: CpuKernelBuildError | None = None

    def register(self) -> Path:
        """The loaded library's path, after building and registering it; idempotent."""
        with self._lock:
            if self._path is not None:
                return self._path
            if self._failure is not None:
                raise self._failure
            try:
                lib = self.library()
                path = build(lib)
                try:
                    loaded = ctypes.CDLL(str(path))
                    symbols = {target: getattr(loaded, symbol) for target, symbol in self.handlers}
                except (OSError, AttributeError) as e:
                    raise lib.error(f"loading {self.what} {path} failed ({e}); delete it to "
                                    f"rebuild. {lib.fallback_hint}") from e
                import jax

                for target, symbol in symbols.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol),
                                                platform="cpu")
            except CpuKernelBuildError as e:
                self._failure = e
                raise
            self._path = path
            return path

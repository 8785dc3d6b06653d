"""Every platform rule in one object: `Platform` (interface.py) and its kinds.

    platform = current_platform()              # this process's devices, resolved once
    platform = platform_for_target("h200")     # a `jaxserve compile` target (no device)
    platform = platform_of_device(device)      # where a set of parameters lives

The only place in jaxserve that looks at a platform's name (tests/test_platform_rules.py).
"""

from __future__ import annotations

import functools

import jax

from jaxserve.platforms.cpu import CpuPlatform
from jaxserve.platforms.gpu import GpuPlatform
from jaxserve.platforms.interface import Platform
from jaxserve.platforms.tpu import TpuPlatform

__all__ = ["CpuPlatform", "GpuPlatform", "Platform", "TpuPlatform", "current_platform",
           "platform_for_target", "platform_named", "platform_of_device"]

_GPU_NAMES = ("gpu", "cuda", "rocm")


def platform_named(name: str) -> Platform:
    """The platform jax calls `name` ("cpu", "gpu", "cuda", "rocm", "tpu")."""
    if name == "cpu":
        return CpuPlatform()
    if name in _GPU_NAMES:
        return GpuPlatform(name)
    if name == "tpu":
        return TpuPlatform()
    raise ValueError(f"unsupported platform {name!r}; jaxserve runs on cpu, gpu (cuda) and tpu")


@functools.cache
def current_platform() -> Platform:
    """This process's devices' platform (jax's default backend), resolved once."""
    return platform_named(jax.default_backend())


def platform_of_device(device: jax.Device | None) -> Platform:
    """The platform of `device` (None: this process's): a compile-only target device is
    the target's platform, not this machine's."""
    if device is None:
        return current_platform()
    return platform_named(device.platform)


def platform_for_target(target: str | None) -> Platform:
    """The platform `jaxserve compile --target TARGET` builds for: a named GPU (its memory
    and compile options), or this machine's CPU for None / "cpu"."""
    if target is None or target == "cpu":
        return CpuPlatform()
    from jaxserve.platforms.gpu_targets import load_target

    return GpuPlatform("cuda", load_target(target))

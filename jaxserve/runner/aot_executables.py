"""A directory of step executables compiled ahead of time (`jaxserve compile`), and the
manifest that says what they were compiled for.

    DIR/manifest.json           target, device kind, devices, versions, engine config hash,
                                KV blocks, the memory plan, one entry per bucket
    DIR/step-<T>x<S>.bin        pickle of (serialized executable, in_tree, out_tree); a
                                pipeline-parallel engine's: a list of them, one per stage

`jaxserve serve --aot-dir DIR` (engine/aot_compile.py `open_aot_dir`) loads them instead of
compiling when every manifest field matches the engine about to start; anything else
(another GPU, other jax/jaxlib/plugin versions, another engine config or jaxserve source)
falls back to compiling, with one warning that names the difference. The directory is never
written at serve time: a shipped artifact stays what was compiled.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1


def bucket_file(shape: tuple[int, int]) -> str:
    return f"step-{shape[0]}x{shape[1]}.bin"


def serialize_step(executable: Any) -> bytes:
    """One bucket's executable as bytes (a PipelineExecutables: each stage's, in order)."""
    from jax.experimental import serialize_executable

    from jaxserve.runner.pipeline_runner import PipelineExecutables

    if isinstance(executable, PipelineExecutables):
        return pickle.dumps([serialize_executable.serialize(stage)
                             for stage in executable.stages])
    return pickle.dumps(serialize_executable.serialize(executable))


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    write_atomically(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{directory} has no {MANIFEST}; write one with `jaxserve compile "
                         "MODEL --output DIR`") from None
    except ValueError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: manifest format {manifest.get('format')!r}, this jaxserve "
                         f"reads format {FORMAT}")
    return manifest


def mismatch(manifest: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """The first field where what was compiled differs from what this engine needs, said
    for a person (None: they all agree)."""
    for key, want in expected.items():
        have = manifest.get(key)
        if have != want:
            return f"{key}: compiled for {have!r}, this engine needs {want!r}"
    return None


class AotExecutables:
    """The runner's executable source (the interface of runner/executable_cache.py): loads
    a bucket's executable from the directory onto ``devices`` (by position: the compile's
    device i is devices[i]); a missing bucket is a miss (the runner compiles it), and
    nothing is stored. stage_devices (pipeline parallel): each stage's devices, in stage
    order; a bucket is then one executable per stage (a PipelineExecutables)."""

    def __init__(self, directory: str | os.PathLike, devices: list[Any],
                 stage_devices: list[list[Any]] | None = None) -> None:
        self.directory = Path(directory)
        self.devices = list(devices)
        self.stage_devices = stage_devices
        self.hits = 0
        self.misses = 0

    def compiling(self) -> Any:
        import contextlib

        return contextlib.nullcontext(lambda: True)     # compiled here: never stored

    def load(self, shape: tuple[int, int]) -> Any | None:
        from jax.experimental import serialize_executable

        from jaxserve.runner.pipeline_runner import PipelineExecutables

        path = self.directory / bucket_file(shape)
        try:
            data = pickle.loads(path.read_bytes())
            if self.stage_devices is None:
                executable = serialize_executable.deserialize_and_load(
                    *data, execution_devices=self.devices)
            else:
                if not isinstance(data, list) or len(data) != len(self.stage_devices):
                    raise ValueError(f"not {len(self.stage_devices)} pipeline stages")
                executable = PipelineExecutables([
                    serialize_executable.deserialize_and_load(*stage, execution_devices=devices)
                    for stage, devices in zip(data, self.stage_devices)])
        except Exception as e:    # missing or unreadable: compile it, never fail the start
            logger.warning("ahead-of-time step %s not loaded from %s (%s: %s); compiling it",
                           shape, path, type(e).__name__, e)
            self.misses += 1
            return None
        self.hits += 1
        return executable

    def store(self, shape: tuple[int, int], executable: Any) -> None:
        return None

    def store_compiled(self, shape: tuple[int, int], executable: Any,
                       from_jax_cache: bool) -> None:
        return None


def execution_devices(mesh: Any) -> list[Any]:
    """The devices a step runs on, in the order a compile for the same mesh shape numbers
    them: the mesh's, or the default device."""
    return list(mesh.devices.flat) if mesh is not None else [jax.devices()[0]]

"""A model as it sits in device memory, saved with orbax-checkpoint, for restarts in seconds.

`jaxserve convert MODEL OUT` (entrypoints/convert.py) writes:

    OUT/jaxserve_checkpoint.json   format, architecture, dtype, quantization, KV-head copies
    OUT/config.json                the model's full Hugging Face config (every field, not a diff)
    OUT/generation_config.json     when the source had one
    OUT/tokenizer.json, ...        the tokenizer as a HF tokenizer directory (a GGUF's too)
    OUT/params/                    the params tree (final dtype, quantized) as orbax arrays

`LLM(OUT)` / `jaxserve serve OUT` restore each array straight onto the sharding the
restoring engine's placement gives it: each device (each host) reads only its own shards,
and no full host copy of the model is made. Any tensor-parallel size restores the same
checkpoint, as long as it needs the same KV-head replication as the one it was converted at
(tp <= num_key_value_heads needs none), so data-parallel replicas share one checkpoint.

Nothing here imports torch: the config is read as plain attributes (families only read
attributes of it), and the tokenizer with `PreTrainedTokenizerFast` (AutoTokenizer would
build a transformers config class, which imports torch).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from jaxserve.dtypes import dtype_by_name

MANIFEST = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
FORMAT = "jaxserve-orbax"
FORMAT_VERSION = 1

logger = logging.getLogger(__name__)


def is_checkpoint(directory: str | os.PathLike) -> bool:
    return (Path(directory) / MANIFEST).is_file()


@dataclass
class CheckpointInfo:
    """What a checkpoint directory says about itself, read without touching its arrays."""
    path: Path
    manifest: dict[str, Any]
    hf_config: Any                       # attribute view of config.json
    generation_config: dict[str, Any]

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def quantization(self) -> str | None:
        return self.manifest.get("quantization")

    @property
    def kv_head_copies(self) -> int:
        return int(self.manifest.get("kv_head_copies", 1))


def read_checkpoint(directory: str | os.PathLike) -> CheckpointInfo:
    """The manifest and config of a converted checkpoint; clear errors for a foreign one."""
    path = Path(directory)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a jaxserve checkpoint (no {MANIFEST}); "
                                "make one with `jaxserve convert MODEL OUT`") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path / MANIFEST}: format {manifest.get('format')!r} version "
                         f"{manifest.get('version')!r}; this jaxserve reads {FORMAT!r} version "
                         f"{FORMAT_VERSION}: re-run `jaxserve convert`")
    config = json.loads((path / "config.json").read_text())
    generation_path = path / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    return CheckpointInfo(path=path, manifest=manifest, hf_config=SimpleNamespace(**config),
                          generation_config=generation)


def load_checkpoint_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer saved beside the arrays (a fast tokenizer: tokenizer.json)."""
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory),
                                                                local_files_only=True)


def _config_dict(hf_config: Any) -> dict[str, Any]:
    if hasattr(hf_config, "to_dict"):        # a transformers config: every field, not a diff
        return hf_config.to_dict()
    return dict(vars(hf_config))


def save_checkpoint(out: str | os.PathLike, params: Any, *, hf_config: Any, tokenizer: Any,
                    generation_config: dict[str, Any], dtype: str, quantization: str | None,
                    kv_head_copies: int, tensor_parallel_size: int, source: str) -> Path:
    """Write `params` (device arrays, any sharding) and everything needed to serve them.

    Every process of a multi-host run calls this (orbax writes each process's shards);
    `out` must not exist yet, so a half-written or older checkpoint is never mixed in."""
    import jax
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    # Uncompressed: zstd saves little on weights (a third on SmolLM2 in float32, less in
    # bfloat16) and every start pays to decompress them (1.3 s -> 0.8 s of CPU to restore
    # SmolLM2's 513 MiB). Checkpoints written compressed still restore (self-describing).
    handler = ocp.PyTreeCheckpointHandler(use_compression=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(out / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    if jax.process_index() == 0:
        (out / "config.json").write_text(json.dumps(_config_dict(hf_config), indent=2,
                                                    default=str))
        if generation_config:
            (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
        tokenizer.save_pretrained(str(out))
        manifest = {"format": FORMAT, "version": FORMAT_VERSION,
                    "architecture": getattr(hf_config, "architectures", [None])[0],
                    "dtype": dtype, "quantization": quantization,
                    "kv_head_copies": kv_head_copies,
                    "converted_tensor_parallel_size": tensor_parallel_size,
                    "source": source, "jax_version": jax.__version__}
        # Written last: its presence means the checkpoint is complete.
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


def restore_targets(info: CheckpointInfo, mesh: Any, param_spec: Any,
                    dtype: Any = None) -> Any:
    """The params tree as ShapeDtypeStructs on `mesh` with the family's partition specs (or
    on the default device when mesh is None), read from the checkpoint's metadata: what
    `restore_params` will return, known before a byte of it is read. dtype: the float
    arrays stored in the checkpoint's dtype are restored as this one (orbax casts while it
    reads); None keeps them."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, SingleDeviceSharding

    from jaxserve.mesh import MODEL_AXIS
    from jaxserve.models import partition

    with ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(info.path / PARAMS_DIR).item_metadata.tree
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, metadata)
    else:
        specs = partition.param_specs(metadata, mesh.shape[MODEL_AXIS], param_spec)
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    stored = np.dtype(dtype_by_name(info.dtype))

    def restored_dtype(meta: Any) -> np.dtype:
        kind = np.dtype(meta.dtype)
        return np.dtype(dtype) if dtype is not None and kind == stored else kind

    return jax.tree.map(lambda meta, sharding: jax.ShapeDtypeStruct(
        tuple(meta.shape), restored_dtype(meta), sharding=sharding), metadata, shardings)


def restore_params(info: CheckpointInfo, mesh: Any, param_spec: Any,
                   target: Any = None) -> Any:
    """The params tree restored onto `mesh` with the family's partition specs (each device
    reads only its shards), or onto the default device when mesh is None. target: what
    `restore_targets` returned, if the caller has it already."""
    import jax
    import orbax.checkpoint as ocp

    directory = info.path / PARAMS_DIR
    start = time.perf_counter()
    if target is None:
        target = restore_targets(info, mesh, param_spec)
    checkpointer = ocp.StandardCheckpointer()
    params = checkpointer.restore(directory, target)
    checkpointer.close()
    logger.info("restored %.1f MiB of parameters from %s in %.2f s",
                sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20, directory,
                time.perf_counter() - start)
    return params


def remove_incomplete(out: str | os.PathLike) -> None:
    """Remove a checkpoint directory a failed convert left without its manifest."""
    out = Path(out)
    if out.is_dir() and not is_checkpoint(out):
        shutil.rmtree(out)

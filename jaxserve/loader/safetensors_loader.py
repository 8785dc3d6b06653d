"""Read Hugging Face safetensors checkpoints (single file or sharded) into our layout.

We parse the safetensors header ourselves and view each tensor straight from a
memory map (no copy), checking every header entry against the file so a malformed
checkpoint fails naming the file and tensor. The format is an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets}}``, then the raw little-endian data.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.loader.awq_gptq_loader import PackedProjections, quantized_projections
from jaxserve.loader.weights import StackedWeights, is_ignorable, parse_name
from jaxserve.models.registry import family_for, read_arch
from jaxserve.quantization.awq_gptq import PackedIntConfig

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file: its header, and zero-copy numpy views of its tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        size = os.path.getsize(self.path)
        try:
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise ValueError("file is shorter than the 8-byte header length")
                header_len = int.from_bytes(prefix, "little")
                if not 2 <= header_len <= min(_MAX_HEADER_BYTES, size - 8):
                    raise ValueError(f"header length {header_len} does not fit in a "
                                     f"{size}-byte file")
                header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise ValueError(f"{self.path}: not a valid safetensors file ({e})") from None
        if not isinstance(header, dict):  # a corrupt file, not a caller's type error
            raise ValueError(  # noqa: TRY004
                f"{self.path}: not a valid safetensors file (header is not a mapping)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.entries: dict[str, dict[str, Any]] = header
        for name, entry in header.items():
            self._check_entry(name, entry, size - self.data_start)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 0 else None

    def _check_entry(self, name: str, entry: Any, data_bytes: int) -> None:
        try:
            dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
            begin, end = (int(x) for x in entry["data_offsets"])
            count = int(np.prod(entry["shape"], dtype=np.int64))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{self.path}: not a valid safetensors file (bad header entry for "
                             f"{name!r}: {e!r})") from None
        if end > data_bytes:
            raise ValueError(f"{self.path}: file is truncated or corrupt: tensor {name!r} ends at "
                             f"byte {end} of the data section, which has only {data_bytes} bytes")
        if not 0 <= begin <= end or end - begin != count * dtype.itemsize:
            raise ValueError(f"{self.path}: not a valid safetensors file (tensor {name!r} has "
                             f"offsets {begin}..{end} for shape {entry['shape']} {entry['dtype']})")

    def names(self) -> list[str]:
        return list(self.entries)

    def get(self, name: str) -> np.ndarray:
        """A read-only view of one tensor, backed by the memory map."""
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]]).newbyteorder("<")
        raw = self._map[self.data_start + begin:self.data_start + end]
        return np.asarray(raw).view(dtype).reshape(entry["shape"])


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, or model.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = sorted({model_dir / shard for shard in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("model*.safetensors"))
    if files:
        return files
    others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    hint = f" (found {others}; only safetensors checkpoints are supported)" if others else ""
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json"
                            f"{hint}")


def _iter_tensors(files: list[SafetensorsFile]) -> Iterator[tuple[str, SafetensorsFile]]:
    for file in files:
        for name in file.names():
            yield name, file


def load_safetensors_weights(model_dir: str | os.PathLike, hf_config: Any,
                             dtype: np.dtype, packed_int: PackedIntConfig | None = None
                             ) -> dict[str, np.ndarray]:
    """All weights of a Hugging Face checkpoint directory, in our stacked layout and `dtype`.
    packed_int: an AWQ / GPTQ checkpoint's config; its packed projections are kept packed
    (loader/awq_gptq_loader.py), everything else is read as a float checkpoint's."""
    files = [SafetensorsFile(path) for path in checkpoint_files(model_dir)]
    arch = read_arch(hf_config)
    family = family_for(arch.architecture)
    shapes = family.weight_shapes(arch)
    packed = None
    if packed_int is not None:
        kernels = quantized_projections([n for f in files for n in f.names()], family)
        packed = PackedProjections(packed_int, family, shapes, kernels, str(model_dir))
        shapes = {n: s for n, s in shapes.items() if n not in kernels}
    stacked = StackedWeights(shapes, dtype, source=str(model_dir))
    unexpected = []
    for name, file in _iter_tensors(files):
        if packed is not None and packed.take(name, lambda: file.get(name)):  # noqa: B023
            continue
        parsed = parse_name(name, "hf", family)
        if parsed is None or not stacked.wants(parsed[0]):
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue  # tied: the output head is the embedding, whatever the file holds
            if not is_ignorable(name):
                unexpected.append(name)
            continue
        stacked.put(parsed[0], parsed[1], file.get(name), origin=f"{name} in {file.path}")
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise ValueError(f"{model_dir}: checkpoint has {len(unexpected)} tensor(s) this loader does "
                         f"not know how to use ({shown}); the model would silently ignore them")
    return stacked.finish() | (packed.finish() if packed is not None else {})

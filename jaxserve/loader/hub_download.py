"""A model by name from the Hugging Face Hub: the local cache first, then a verified download.

    path = fetch_from_hub("Qwen/Qwen3-0.6B", "model", HubOptions(revision="main"))
    # -> .../models--Qwen--Qwen3-0.6B/snapshots/<commit>   (a .gguf file for a GGUF repo)

``huggingface_hub`` does the HTTP and owns the cache layout; its environment is honoured as it
defines it (``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, ``HF_TOKEN``).
Around it this module adds what serving needs:

- the exact file set (loader/hub_files.py), chosen from the repo listing before a byte moves;
  its size printed and the free disk checked first; a gated repo refused with what to do;
- every file checked against the digest the Hub published (loader/hub_verify.py), in the cache
  too: a missing or corrupt file is named and fetched again, never loaded;
- weights resumable across processes (loader/hub_resume.py: after Ctrl-C, a later start
  asks for the rest with ``Range``);
- one download per repo + revision across processes (loader/hub_lock.py): the others wait;
- ``refs/<revision>`` is written only once the whole set is verified, so an interrupted
  download (Ctrl-C, a full disk) never looks complete to a later start;
- progress a person can watch (loader/hub_progress.py).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.loader.hub_files import KINDS, RemoteFile, select_files
from jaxserve.loader.hub_lock import DownloadLock
from jaxserve.loader.hub_verify import BlobVerifier, discard

if TYPE_CHECKING:
    from jaxserve.config import ModelConfig

logger = logging.getLogger(__name__)

_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(ValueError):
    """A model could not be had from the Hub or the cache; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class HubOptions:
    """vLLM's flags for a model by name: --revision, --download-dir, --hf-token, and
    --gguf-file (one file of a GGUF repo). None: huggingface_hub's defaults (main, the HF
    cache, HF_TOKEN or the stored login)."""
    revision: str | None = None
    cache_dir: str | None = None
    token: str | None = None
    gguf_file: str | None = None


def hub_options(model_config: ModelConfig, for_tokenizer: bool = False) -> HubOptions:
    """The Hub options of a ModelConfig (jaxserve/config.py) for its model, or its tokenizer
    (--tokenizer-revision; else --revision when the tokenizer is the model's own)."""
    mc = model_config
    if not for_tokenizer:
        return HubOptions(mc.revision, mc.download_dir, mc.hf_token, mc.gguf_file)
    own = mc.tokenizer is None or mc.tokenizer == mc.model
    return HubOptions(mc.tokenizer_revision or (mc.revision if own else None), mc.download_dir,
                      mc.hf_token)


def hub_endpoint() -> str:
    """HF_ENDPOINT as the Hub client reads it (read now, so a test can set it late)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def hub_cache_dir(options: HubOptions) -> Path:
    """--download-dir, else HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    from huggingface_hub import constants

    if options.cache_dir:
        return Path(os.path.expanduser(options.cache_dir))
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: no network call at all."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return constants.HF_HUB_OFFLINE or (value or "").upper() in ("1", "ON", "YES", "TRUE")


def split_quant_tag(name: str) -> tuple[str, str | None]:
    """``org/name:Q4_K_M`` -> ("org/name", "Q4_K_M"); a name without a tag -> (name, None)."""
    repo, sep, tag = name.partition(":")
    return (repo, tag) if sep and tag else (name, None)


def _storage(cache_dir: Path, repo_id: str) -> Path:
    return cache_dir / ("models--" + repo_id.replace("/", "--"))


def _snapshot_in_cache(storage: Path, revision: str) -> Path | None:
    if _COMMIT.fullmatch(revision):
        commit = revision
    else:
        try:
            commit = (storage / "refs" / revision).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _local_listing(snapshot: Path) -> list[RemoteFile]:
    return [RemoteFile(p.relative_to(snapshot).as_posix(), p.stat().st_size, None, None)
            for p in sorted(snapshot.rglob("*")) if p.is_file()]


def _from_cache(snapshot: Path, repo_id: str, kind: str, options: HubOptions,
                verifier: BlobVerifier) -> list[Path]:
    """The cached file set of `kind` if it is complete and every file matches its digest;
    HubError naming what is missing or corrupt (a corrupt file is removed)."""
    try:
        chosen = select_files(_local_listing(snapshot), kind, repo_id, options.gguf_file,
                              read_index=lambda f: (snapshot / f.path).read_bytes())
    except ValueError as e:
        raise HubError(f"incomplete in the cache: {e}") from None
    paths = [snapshot / f.path for f in chosen]
    for path in paths:
        if verifier.matches(path) is False:
            logger.warning("%s in the cache does not match the digest the Hub published for "
                           "it (corrupt or cut short): removing it", path)
            discard(path)
            verifier.save()
            raise HubError(f"{path.name} in the cache was corrupt (removed)")
    verifier.save()
    return paths


def fetch_from_hub(name: str, kind: str = "model", options: HubOptions | None = None) -> Path:
    """The local path of `kind` ("model", "config", "tokenizer", "adapter") of the Hub repo
    `name` (``org/name`` or ``org/name:QUANT``): the cached snapshot directory, or for a GGUF
    repo the one ``.gguf`` file. From the cache when complete and verified; else downloaded,
    unless HF_HUB_OFFLINE. HubError (a ValueError) says what went wrong and what to do."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    options = options or HubOptions()
    repo_id, tag = split_quant_tag(name)
    if tag is not None and options.gguf_file is None:
        options = HubOptions(options.revision, options.cache_dir, options.token, tag)
    revision = options.revision or "main"
    cache_dir = hub_cache_dir(options)
    storage = _storage(cache_dir, repo_id)
    label = f"{repo_id}@{revision}"

    def cached() -> tuple[Path | None, str]:
        snapshot = _snapshot_in_cache(storage, revision)
        if snapshot is None:
            return None, f"{label} is not in the cache {cache_dir}"
        try:
            files = _from_cache(snapshot, repo_id, kind, options, BlobVerifier(storage))
        except HubError as e:
            return None, f"{label}: {e}"
        return _result(snapshot, files), ""

    found, why = cached()
    if found is not None:
        logger.debug("%s from the cache: %s", label, found)
        return found
    if hub_offline():
        raise HubError(f"HF_HUB_OFFLINE is set and {why}; download it where the Hub is "
                       f"reachable (`jaxserve download {name}`, into the same HF_HUB_CACHE or "
                       "--download-dir), or unset HF_HUB_OFFLINE")
    lock_name = f"{storage.name}--{revision.replace('/', '--')}.lock"
    with DownloadLock(cache_dir / ".locks" / "jaxserve" / lock_name, what=label):
        found, _ = cached()      # another process may have fetched it while we waited
        if found is not None:
            return found
        from jaxserve.loader.hub_fetch import download_file_set

        snapshot, files = download_file_set(repo_id, revision, kind, options, cache_dir,
                                            storage, hub_endpoint())
    return _result(snapshot, files)


def _result(snapshot: Path, files: list[Path]) -> Path:
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    return ggufs[0] if len(ggufs) == 1 and len(files) == 1 else snapshot


def free_bytes(directory: Path) -> tuple[int, Path]:
    """Free bytes on the filesystem that will hold `directory` (its first existing ancestor)."""
    probe = directory
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free, probe

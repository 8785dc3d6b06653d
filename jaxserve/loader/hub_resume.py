"""A large (LFS) file into the Hugging Face cache, resumable across processes.

huggingface_hub 2.x downloads each file to a process-unique temporary file and deletes it
when the process stops, so a 16 GB shard cut by Ctrl-C starts again from zero. Here the
bytes go to ``blobs/<sha256>.jaxserve-partial`` (one writer at a time: the caller holds the
repo + revision's download lock); a later start sends ``Range`` from where it stopped. The
file becomes ``blobs/<sha256>`` (what the cache and every later start trust) only once its
sha256 is the Hub's, so a partial file, a full disk or a wrong byte never looks complete.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from jaxserve.loader.hub_verify import file_digest

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".jaxserve-partial"


def download_blob(url: str, blob: Path, sha256: str, size: int, token: str | None,
                  bar_class: type | None) -> bool:
    """Fetch `url` into `blob` (resuming a partial file); False, and nothing kept, when the
    bytes do not hash to `sha256`."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    blob.parent.mkdir(parents=True, exist_ok=True)
    partial = blob.with_name(blob.name + PARTIAL_SUFFIX)
    resume = partial.stat().st_size if partial.exists() else 0
    if resume > size:
        partial.unlink()
        resume = 0
    if resume:
        logger.info("resuming %s at %.1f of %.1f MB", blob.name[:12], resume / 1e6, size / 1e6)
    with open(partial, "r+b" if resume else "wb") as f:
        f.seek(resume)
        f.truncate()
        http_get(url, f, resume_size=resume, headers=build_hf_headers(token=token),
                 expected_size=size, tqdm_class=bar_class)
    if file_digest(partial, sha256) != sha256:
        partial.unlink()
        return False
    os.replace(partial, blob)
    return True


def link_into_snapshot(blob: Path, pointer: Path) -> None:
    """The snapshot's entry for a file: a relative symlink to its blob, as huggingface_hub
    makes them (a copy where symlinks are not allowed)."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError:
        import shutil

        shutil.copyfile(blob, pointer)

"""Is a file in the Hugging Face cache what the Hub published? (sha256 / git blob sha1)

The cache names each blob by the digest the Hub published for it (``X-Linked-Etag``: the
sha256 of a large-file-storage file; else the git blob sha1), so a cached file can be checked
with no network at all. Hashing gigabytes on every start would cost seconds, so a file that
matched is stamped (its size and mtime, in ``jaxserve-verified.json`` beside the repo's
``blobs/``), and re-hashed only when either changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

STAMP_FILE = "jaxserve-verified.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHA1 = re.compile(r"[0-9a-f]{40}")
_CHUNK = 8 << 20


def file_digest(path: str | os.PathLike, expected: str) -> str:
    """The digest of `path` of the kind `expected` is: sha256 (64 hex) or git blob sha1."""
    if _SHA256.fullmatch(expected):
        digest = hashlib.sha256()
    else:
        digest = hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_key(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns]


class BlobVerifier:
    """Checks the blobs of one cached repo (``models--org--name``) against their names."""

    def __init__(self, storage_folder: str | os.PathLike) -> None:
        self.storage = Path(storage_folder)
        self._stamps_path = self.storage / STAMP_FILE
        try:
            self._stamps: dict[str, list[int]] = json.loads(self._stamps_path.read_text())
        except (FileNotFoundError, ValueError):
            self._stamps = {}
        self._dirty = False

    def matches(self, path: str | os.PathLike, expected: str | None = None) -> bool | None:
        """True if the file `path` (a snapshot entry or a blob) matches `expected`, or, when
        not given, the digest its blob is named by; None when there is nothing to check it
        against (a file that is no symlink to a digest-named blob); False if missing."""
        real = Path(os.path.realpath(path))
        if not real.is_file():
            return False
        expected = expected or real.name
        if not (_SHA256.fullmatch(expected) or _SHA1.fullmatch(expected)):
            return None
        stat = real.stat()
        if self._stamps.get(real.name) == _stamp_key(stat) and real.name == expected:
            return True
        ok = file_digest(real, expected) == expected
        if ok and real.name == expected:
            self._stamps[real.name] = _stamp_key(stat)
            self._dirty = True
        return ok

    def record(self, blob: str | os.PathLike) -> None:
        """Stamp a blob just verified (its name is its digest) so no start hashes it again."""
        real = Path(os.path.realpath(blob))
        self._stamps[real.name] = _stamp_key(real.stat())
        self._dirty = True

    def save(self) -> None:
        """Write the stamps (atomically: concurrent writers lose at most each other's news)."""
        if not self._dirty:
            return
        tmp = self._stamps_path.with_name(f"{STAMP_FILE}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            tmp.write_text(json.dumps(self._stamps))
            os.replace(tmp, self._stamps_path)
        except OSError as e:     # a read-only cache still loads; it re-hashes next time
            logger.debug("could not write %s: %s", self._stamps_path, e)
            tmp.unlink(missing_ok=True)
        self._dirty = False


def discard(snapshot_file: str | os.PathLike) -> None:
    """Remove a bad cached file: its blob and the snapshot's link to it."""
    real = os.path.realpath(snapshot_file)
    for path in {real, os.fspath(snapshot_file)}:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:     # a read-only cache: the caller still refuses the file
            logger.warning("could not remove %s: %s", path, e)

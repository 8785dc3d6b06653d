"""The network half of loader/hub_download.py: list the repo, plan, check, download, verify.

Called with the repo + revision's download lock held. Every Hub error becomes one
HubError line saying what to do (no traceback reaches a user for a missing or gated repo).
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from jaxserve.loader.hub_download import HubError, HubOptions, free_bytes
from jaxserve.loader.hub_files import RemoteFile, select_files
from jaxserve.loader.hub_progress import DownloadProgress
from jaxserve.loader.hub_resume import PARTIAL_SUFFIX, download_blob, link_into_snapshot
from jaxserve.loader.hub_verify import BlobVerifier, discard

logger = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


def _network_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's transport errors (huggingface_hub 2 uses httpx2, 1.x httpx)."""
    try:
        import httpx2 as client
    except ImportError:
        import httpx as client
    return (client.HTTPError,)


def explain(error: Exception, repo_id: str, revision: str, endpoint: str,
            token: str | None) -> HubError:
    """One line for a Hub client error: what happened and what to do about it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"{endpoint}/{repo_id}"
    if isinstance(error, GatedRepoError):
        refused = ("the token given was refused for it (403): " if token or
                   error.response.status_code == 403 else "no token was given (401): ")
        return HubError(f"{repo_id!r} is a gated model and {refused}accept its licence on "
                        f"{page} while logged in, then set HF_TOKEN (or --hf-token) to a "
                        "token of that account")
    if isinstance(error, RepositoryNotFoundError):
        return HubError(f"the Hub at {endpoint} (HF_ENDPOINT) has no model repo {repo_id!r}, "
                        "or it is private and needs HF_TOKEN / --hf-token; check the name")
    if isinstance(error, RevisionNotFoundError):
        return HubError(f"the Hub repo {repo_id!r} at {endpoint} has no revision {revision!r} "
                        "(--revision: a branch, tag or commit id)")
    if isinstance(error, RemoteEntryNotFoundError):
        return HubError(f"{repo_id}@{revision}: a file it listed is gone from {endpoint} "
                        f"({error.response.url}); the repo changed during the download, retry")
    if isinstance(error, HfHubHTTPError):
        return HubError(f"the Hub at {endpoint} answered {error.response.status_code} for "
                        f"{repo_id}@{revision}: {str(error).splitlines()[0]}")
    if isinstance(error, (*_network_errors(), OSError)):
        return HubError(f"cannot reach the Hub at {endpoint} (HF_ENDPOINT) for {repo_id}@"
                        f"{revision} ({type(error).__name__}: {error}), and it is not in the "
                        "cache; check the network, or fetch it where the Hub is reachable "
                        "(`jaxserve download`) and set HF_HUB_OFFLINE=1")
    raise error


def download_file_set(repo_id: str, revision: str, kind: str, options: HubOptions,
                      cache_dir: Path, storage: Path, endpoint: str) -> tuple[Path, list[Path]]:
    """(snapshot directory, the chosen files in it), every file verified."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi(endpoint=endpoint, token=options.token).model_info(
            repo_id, revision=revision, files_metadata=True)
        commit = info.sha
        listing = [RemoteFile(s.rfilename, s.lfs.size if s.lfs else (s.size or 0),
                              s.lfs.sha256 if s.lfs else None, s.blob_id)
                   for s in info.siblings or ()]
        fetcher = _Fetcher(repo_id, commit, options, cache_dir, storage, endpoint)
        chosen = select_files(listing, kind, repo_id, options.gguf_file,
                              read_index=lambda f: fetcher.get(f).read_bytes())
        if info.gated or info.private:
            fetcher.check_access(chosen[0])
        fetcher.plan(chosen, f"{repo_id}@{revision}")
        try:
            paths = [fetcher.get(f) for f in chosen]
        finally:
            if fetcher.progress is not None:
                fetcher.progress.close()
    except HubError:
        raise
    except ValueError as e:     # the repo holds no usable file set (hub_files says why)
        raise HubError(str(e)) from None
    except OSError as e:
        if e.errno in _DISK_FULL and not isinstance(e, HfHubHTTPError):
            raise HubError(f"{repo_id}@{revision}: the disk filled while downloading into "
                           f"{storage} ({e.strerror}); free space (or pick another cache with "
                           "--download-dir) and start again: the download resumes where it "
                           "stopped, and nothing partial is ever loaded") from None
        raise explain(e, repo_id, revision, endpoint, options.token) from None
    except _network_errors() as e:
        raise explain(e, repo_id, revision, endpoint, options.token) from None
    if revision != commit:
        # Last, once all is verified: only now does `revision` lead to this snapshot.
        ref = storage / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return storage / "snapshots" / commit, paths


class _Fetcher:
    """Downloads files of one commit into the cache, each checked against its digest."""

    def __init__(self, repo_id: str, commit: str, options: HubOptions, cache_dir: Path,
                 storage: Path, endpoint: str) -> None:
        self.repo_id, self.commit, self.options = repo_id, commit, options
        self.cache_dir, self.storage, self.endpoint = cache_dir, storage, endpoint
        self.verifier = BlobVerifier(storage)
        self.progress: DownloadProgress | None = None
        self._done: dict[str, Path] = {}

    def check_access(self, first: RemoteFile) -> None:
        """A gated or private repo: one HEAD says whether this token may read it."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        get_hf_file_metadata(hf_hub_url(self.repo_id, first.path, revision=self.commit,
                                        endpoint=self.endpoint), token=self.options.token)

    def _pointer(self, file: RemoteFile) -> Path:
        return self.storage / "snapshots" / self.commit / file.path

    def _cached_ok(self, file: RemoteFile) -> bool:
        """True when the file's blob is in the cache and matches; a bad blob is removed."""
        blob = self.storage / "blobs" / (file.etag or "")
        if not file.etag or not blob.is_file():
            return False
        if self.verifier.matches(blob, file.etag):
            return True
        logger.warning("%s in the cache does not match the Hub's digest %s: downloading it "
                       "again", file.path, file.etag)
        discard(blob)
        self._pointer(file).unlink(missing_ok=True)
        return False

    def _kept(self, file: RemoteFile) -> int:
        """Bytes of `file` a stopped download left (it resumes from there)."""
        if not file.sha256:
            return 0
        partial = self.storage / "blobs" / (file.sha256 + PARTIAL_SUFFIX)
        return min(partial.stat().st_size, file.size) if partial.is_file() else 0

    def plan(self, files: list[RemoteFile], label: str) -> None:
        """Print what will move, and refuse when the disk cannot hold it."""
        missing = [f for f in files if not self._cached_ok(f)]
        self.verifier.save()
        total = sum(f.size for f in files)
        needed = sum(f.size - self._kept(f) for f in missing)
        logger.info("%s (commit %s): %d files, %s; %s to download into %s", label,
                    self.commit[:12], len(files), _size(total), _size(needed), self.storage)
        free, where = free_bytes(self.storage)
        if needed > free:
            raise HubError(f"{label} needs {_size(needed)}, {_size(free)} free in {where}: free "
                           "space there, or pick another cache with --download-dir / "
                           "HF_HUB_CACHE")
        self.progress = DownloadProgress(needed, label)

    def get(self, file: RemoteFile) -> Path:
        """The file in the snapshot, downloaded unless its blob is cached and matches."""
        if file.path in self._done:
            return self._done[file.path]
        from huggingface_hub import hf_hub_download, hf_hub_url

        pointer = self._pointer(file)
        for attempt in (1, 2):
            if self._cached_ok(file):
                if not pointer.exists():        # the blob of another revision: link it
                    if file.sha256:
                        link_into_snapshot(self.storage / "blobs" / file.sha256, pointer)
                    else:
                        hf_hub_download(self.repo_id, file.path, revision=self.commit,
                                        cache_dir=str(self.cache_dir), token=self.options.token,
                                        endpoint=self.endpoint)
                break
            bar_class = self.progress.bar_class if self.progress else None
            if file.sha256:     # weights: resumable, verified before they become a blob
                url = hf_hub_url(self.repo_id, file.path, revision=self.commit,
                                 endpoint=self.endpoint)
                blob = self.storage / "blobs" / file.sha256
                ok = download_blob(url, blob, file.sha256, file.size, self.options.token,
                                   bar_class)
                if ok:
                    self.verifier.record(blob)
                    link_into_snapshot(blob, pointer)
                    break
            else:
                path = hf_hub_download(self.repo_id, file.path, revision=self.commit,
                                       cache_dir=str(self.cache_dir), token=self.options.token,
                                       endpoint=self.endpoint, tqdm_class=bar_class)
                # Checked against the digest its blob is named by: the ETag the Hub sent
                # for it (the listing's blob id of a file stored in LFS is its pointer's).
                if self.verifier.matches(path) is not False:
                    break
                discard(path)
            if attempt == 2:
                raise HubError(f"{file.path} of {self.repo_id}@{self.commit[:12]} did not match "
                               f"the Hub's digest {file.etag} after two downloads (removed); "
                               "the Hub or a proxy serves other bytes than it publishes")
            logger.warning("%s downloaded does not match the Hub's digest %s: downloading it "
                           "again", file.path, file.etag)
        self.verifier.save()
        self._done[file.path] = pointer
        return pointer

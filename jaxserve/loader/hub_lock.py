"""One download per model across processes and hosts: a lock file that holds on NFS.

    with DownloadLock(path, what="tiny-org/tiny-llama@main"):
        ...   # download; other processes wait here, then read the cache

``flock`` does nothing on many network filesystems, so the lock is an exclusively created
file (``O_CREAT | O_EXCL``, atomic on NFSv3+ and local disks) holding the holder's pid and
host. The holder touches it every few seconds (a heartbeat); a lock is stale, and taken over,
when its holder's pid is gone on this host, or when it has not been touched for
``stale_after`` seconds (a holder on another host that died).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0
STALE_AFTER_SECONDS = 60.0
POLL_SECONDS = 0.25


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # alive, another user's
        return True
    return True


class DownloadLock:
    """An exclusive-create lock file with a heartbeat; a context manager."""

    def __init__(self, path: str | os.PathLike, what: str,
                 stale_after: float = STALE_AFTER_SECONDS,
                 heartbeat: float = HEARTBEAT_SECONDS) -> None:
        self.path = Path(path)
        self.what = what
        self.stale_after = stale_after
        self.heartbeat = heartbeat
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._token = uuid.uuid4().hex    # tells our lock file from a successor's

    def __enter__(self) -> DownloadLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, waiting (and saying so) while a live holder has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        announced = False
        while not self._try_create():
            holder = self._holder()
            if holder is not None and self._is_stale(holder):
                self._break(holder)
                continue
            if not announced and holder is not None:
                logger.info("waiting for %s: process %s on %s is downloading it (lock %s)",
                            self.what, holder.get("pid"), holder.get("host"), self.path)
                announced = True
            self._stop.wait(POLL_SECONDS)
        self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                      name="jaxserve-download-lock")
        self._beat.start()

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        holder = self._holder()
        if holder is not None and holder.get("token") == self._token:
            self.path.unlink(missing_ok=True)
        self._stop = threading.Event()

    # -- internals ------------------------------------------------------------------------------
    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "token": self._token,
                       "what": self.what, "since": time.time()}, f)
        return True

    def _holder(self) -> dict | None:
        """The lock file's content and age, or None when it vanished (or is being written)."""
        try:
            age = time.time() - self.path.stat().st_mtime
            holder = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        holder["age"] = age
        return holder

    def _is_stale(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            if not _pid_alive(holder["pid"]):
                return True
        return holder["age"] > self.stale_after

    def _break(self, holder: dict) -> None:
        logger.warning("taking over the stale download lock %s of process %s on %s "
                       "(%s; last touched %.0f s ago)", self.path, holder.get("pid"),
                       holder.get("host"), self.what, holder["age"])
        # Rename, then delete: of several waiters breaking the same lock, one rename wins;
        # the others find nothing to rename and go back to creating.
        aside = self.path.with_name(f"{self.path.name}.stale.{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            moved = json.loads(aside.read_text())
        except (FileNotFoundError, ValueError):
            moved = {}
        if moved.get("token") != holder.get("token"):
            # Another waiter broke it first and its fresh lock is what moved: put it back
            # (link is an exclusive create too; it fails only if yet another lock exists).
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                os.utime(self.path)
            except FileNotFoundError:    # broken by another process: we no longer hold it
                logger.warning("the download lock %s was removed while held", self.path)
                return

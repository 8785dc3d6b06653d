"""Run a built jaxserve image here, where there is no Docker daemon: buildah (vfs storage,
chroot isolation) starts the image's entrypoint as the image's user, on the host network,
with host directories mounted as the volume /data and as /tmp. Used by docker/test_image.py
(`make test-image`) and docker/cold_start.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STORAGE_DRIVER = os.environ.get("STORAGE_DRIVER", "vfs")
BUILDAH = ["buildah", "--storage-driver", STORAGE_DRIVER]
IMAGE_UID = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _buildah(*args: str, timeout: float = 600) -> str:
    result = subprocess.run([*BUILDAH, *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def image_exists(image: str) -> bool:
    return subprocess.run([*BUILDAH, "inspect", "--type", "image", image],
                          capture_output=True).returncode == 0


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `root` with its mode, size and mtime (symlinks not followed)."""
    entries = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            entries[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return entries


def changed_paths(before: dict, after: dict) -> list[str]:
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


@dataclass
class Container:
    """A working container of `image` with a fresh volume at /data and its own /tmp."""
    image: str
    name: str = ""
    root: Path = Path()
    volume: Path = Path()
    tmp: Path = Path()
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="jaxserve-img-")))

    def __enter__(self) -> Container:
        self.name = _buildah("from", "--pull-never", self.image)
        self.root = Path(_buildah("mount", self.name))
        self.volume, self.tmp = self.workdir / "data", self.workdir / "tmp"
        self.volume.mkdir()
        self.tmp.mkdir()
        # As a Docker named volume or an fsGroup'd PVC: group 0 may write; /tmp as tmpfs.
        os.chown(self.volume, IMAGE_UID, 0)
        os.chmod(self.volume, 0o2775)
        os.chmod(self.tmp, 0o1777)
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run([*BUILDAH, "rm", self.name], capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def seed_volume_from_image(self) -> None:
        """What Docker does for a new named volume: copy the image's /data into it."""
        shutil.copytree(self.root / "data", self.volume, symlinks=True, dirs_exist_ok=True)
        for directory, dirs, files in os.walk(self.volume):
            for name in [".", *dirs, *files]:
                os.lchown(os.path.join(directory, name), IMAGE_UID, 0)

    def command(self, *argv: str, user: str | None = None) -> list[str]:
        return [*BUILDAH, "run", "--isolation", "chroot",
                "--volume", f"{self.volume}:/data", "--volume", f"{self.tmp}:/tmp",
                *(["--user", user] if user else []), self.name, "--", *argv]

    def run(self, *argv: str, user: str | None = None, timeout: float = 300) -> str:
        result = subprocess.run(self.command(*argv, user=user), capture_output=True, text=True,
                                timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr}")
        return result.stdout

    def entrypoint(self) -> list[str]:
        info = json.loads(_buildah("inspect", "--type", "container", self.name))
        docker = (info.get("Docker") or {}).get("config") or {}
        return list(docker.get("Entrypoint") or info["OCIv1"]["config"]["Entrypoint"])


class Server:
    """`jaxserve serve` (the image's entrypoint) running in a Container on a free port."""

    def __init__(self, container: Container, *serve_args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = container.workdir / "server.log"
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        argv = [*container.entrypoint(), "--host", "127.0.0.1", "--port", str(self.port),
                *serve_args]
        self.process = subprocess.Popen(container.command(*argv), stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from launch until GET /health answers 200."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not healthy within {timeout} s:\n{self.log()[-4000:]}")

    def serving_pid(self) -> int:
        """The jaxserve process itself (the container's PID 1 under Docker): the descendant
        of buildah whose command line is the entrypoint's."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        stack = [self.process.pid]
        while stack:
            pid = stack.pop()
            try:
                argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # buildah-chroot-exec (the helper that execs it) carries the same arguments.
            if b"serve" in argv and any(a.endswith(b"jaxserve") for a in argv[:2]) \
                    and str(self.port).encode() in argv and b"buildah" not in argv[0]:
                return pid
            stack.extend(children.get(pid, []))
        raise RuntimeError("the jaxserve process was not found under buildah")

    def terminate(self) -> None:
        """SIGTERM to the server, as `docker stop` sends it (the image's STOPSIGNAL)."""
        os.kill(self.serving_pid(), signal.SIGTERM)

    def stop(self, timeout: float = 120) -> int:
        if self.process.poll() is None:
            try:
                self.terminate()
            except (RuntimeError, ProcessLookupError):
                pass
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return self.process.returncode


def served_model(base_url: str) -> str:
    """The name the server serves its model under (GET /v1/models)."""
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def stream_chat(base_url: str, content: str, max_tokens: int, on_first_token=None) -> dict:
    """A streamed chat completion read to its end: the text, the finish reason, whether
    [DONE] came, and the seconds to the first content token."""
    body = {"model": served_model(base_url), "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": content}]}
    start, first, text, finish, done = time.monotonic(), None, [], None, False
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                      timeout=httpx.Timeout(600, connect=10)) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            piece = choice.get("delta", {}).get("content")
            if piece:
                text.append(piece)
                if first is None:
                    first = time.monotonic() - start
                    if on_first_token:
                        on_first_token()
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "finish_reason": finish, "done": done,
            "first_token_s": first, "chunks": len(text)}

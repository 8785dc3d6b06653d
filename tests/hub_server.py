"""A Hugging Face Hub on loopback, for the download tests (``HF_ENDPOINT=hub.endpoint``).

It serves repos laid out in a folder, one sub-folder per branch::

    ROOT/tiny-org/tiny-llama/main/config.json
    ROOT/tiny-org/tiny-llama/main/model.safetensors
    ROOT/tiny-org/tiny-llama/other-branch/...

with the HTTP the installed ``huggingface_hub`` speaks: repo info
(``/api/models/{repo}/revision/{rev}``), tree listing (``/api/models/{repo}/tree/{rev}``),
``/{repo}/resolve/{rev}/{file}`` (HEAD and GET, ``X-Repo-Commit``, ``ETag`` = the git blob
sha1, for large-file-storage files ``X-Linked-Etag`` = their sha256 and ``X-Linked-Size``,
``Range``), and the Hub's error shapes (``X-Error-Code`` RepoNotFound / RevisionNotFound /
EntryNotFound / GatedRepo). Every request is logged in ``hub.requests``.

    hub = HubServer(root, gated={"tiny-org/gated"}, token="hf_secret").start()
    os.environ["HF_ENDPOINT"] = hub.endpoint
    ...
    hub.stop()

Run as a script to serve the test repos until interrupted (the request log on stdout):
``python -m tests.hub_server /tmp/hub --build --port 8765``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = "hf_loopback_test_token"     # the token a gated repo of this Hub accepts
# Files the real Hub stores in large-file storage (what .gitattributes marks as LFS there).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".png", ".jpg", ".msgpack", ".h5")


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str          # URL path, unquoted, without the query
    range: str | None  # the Range header
    authorized: bool   # carried the right Bearer token


@dataclass(frozen=True)
class _Entry:
    path: str
    size: int
    git_sha1: str
    sha256: str | None   # LFS files only


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


_described: dict[tuple, list[_Entry]] = {}
_described_lock = threading.Lock()


def _describe(root: Path) -> list[_Entry]:
    """The files under `root` with their digests (hashed again only when a file changed)."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    key = (str(root), tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    with _described_lock:
        if key not in _described:
            _described[key] = _hash_files(root, files)
        return _described[key]


def _hash_files(root: Path, files: list[Path]) -> list[_Entry]:
    entries = []
    for file in files:
        data = file.read_bytes()
        rel = file.relative_to(root).as_posix()
        lfs = rel.endswith(LFS_SUFFIXES)
        entries.append(_Entry(rel, len(data), _git_blob_sha1(data),
                              hashlib.sha256(data).hexdigest() if lfs else None))
    return entries


def _download_name(url_path: str) -> str:
    """"/org/name/resolve/REV/dir/file" -> "org/name/dir/file"."""
    org, name, _, _, filename = url_path.strip("/").split("/", 4)
    return f"{org}/{name}/{filename}"


def _commit_of(entries: list[_Entry]) -> str:
    """A stable 40-hex commit id for a branch's content (changes when any file does)."""
    digest = hashlib.sha1()
    for e in entries:
        digest.update(f"{e.path}\0{e.git_sha1}\n".encode())
    return digest.hexdigest()


class HubServer:
    """The loopback Hub: ``start()`` it, point ``HF_ENDPOINT`` at ``endpoint``.

    gated: repo ids whose files need ``Authorization: Bearer <token>`` (their info stays
    public, as on the Hub). drop_once: file paths ("org/name/file") whose first GET sends
    the headers and half the body, then closes the connection. hold: file paths whose GETs
    wait until ``release`` is set (a download kept in flight while a test looks at it);
    stall_once: file paths whose first GET sends half the body, then waits for ``release``
    (a download in flight when its process is interrupted).
    """

    def __init__(self, root: Path, gated: set[str] = frozenset(), token: str | None = None,
                 drop_once: set[str] = frozenset(), hold: set[str] = frozenset(),
                 stall_once: set[str] = frozenset(), port: int = 0) -> None:
        self.root = Path(root)
        self.gated = set(gated)
        self.token = token
        self.drop_once = set(drop_once)
        self.hold = set(hold)
        self.stall_once = set(stall_once)
        self.release = threading.Event()
        self.requests: list[LoggedRequest] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="loopback-hub")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def log(self, request: LoggedRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def downloads(self) -> list[str]:
        """Paths ("org/name/file") of every GET of a file's bytes, in order."""
        with self._lock:
            return [_download_name(r.path) for r in self.requests
                    if r.method == "GET" and "/resolve/" in r.path]

    def commit(self, repo_id: str, branch: str = "main") -> str:
        return _commit_of(_describe(self.root / repo_id / branch))

    # -- lookups shared by the handler ---------------------------------------------------------
    def branch_dir(self, repo_id: str, revision: str) -> Path | None:
        """The folder holding `repo_id` at `revision` (a branch name or a commit id)."""
        repo = self.root / repo_id
        for branch in sorted(p for p in repo.iterdir() if p.is_dir()):
            if revision in (branch.name, _commit_of(_describe(branch))):
                return branch
        return None


def _handler_for(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:    # the hub's own log replaces stderr's
            pass

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self._serve(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._serve(body=True)

        # -- routing -------------------------------------------------------------------------
        def _serve(self, body: bool) -> None:
            url = urllib.parse.urlsplit(self.path)
            path = urllib.parse.unquote(url.path)
            authorized = hub.token is not None and \
                self.headers.get("Authorization") == f"Bearer {hub.token}"
            hub.log(LoggedRequest(self.command, path, self.headers.get("Range"), authorized))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(parts[2] + "/" + parts[3], parts[4:], url.query, body)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]),
                              authorized, body)
            else:
                self._error(404, "RepoNotFound", "Repository not found", body)

        def _branch(self, repo_id: str, revision: str, body: bool) -> Path | None:
            if not (hub.root / repo_id).is_dir():
                self._error(404, "RepoNotFound", "Repository not found", body)
                return None
            branch = hub.branch_dir(repo_id, revision)
            if branch is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return branch

        def _api(self, repo_id: str, rest: list[str], query: str, body: bool) -> None:
            if rest[:1] == ["revision"] and len(rest) >= 2:
                revision = "/".join(rest[1:])
            elif not rest:
                revision = "main"
            elif rest[:1] == ["tree"] and len(rest) >= 2:
                self._tree(repo_id, rest[1], "/".join(rest[2:]), body)
                return
            else:
                self._error(404, "RepoNotFound", "Repository not found", body)
                return
            branch = self._branch(repo_id, revision, body)
            if branch is None:
                return
            entries = _describe(branch)
            siblings = [{"rfilename": e.path, "size": e.size, "blobId": e.git_sha1,
                         **({"lfs": {"sha256": e.sha256, "size": e.size, "pointerSize": 134}}
                            if e.sha256 else {})} for e in entries]
            info = {"_id": repo_id, "id": repo_id, "modelId": repo_id, "private": False,
                    "gated": "manual" if repo_id in hub.gated else False, "disabled": False,
                    "sha": _commit_of(entries), "siblings": siblings, "tags": [],
                    "downloads": 0, "likes": 0}
            self._json(info, body)

        def _tree(self, repo_id: str, revision: str, under: str, body: bool) -> None:
            branch = self._branch(repo_id, revision, body)
            if branch is None:
                return
            listing = [{"type": "file", "oid": e.git_sha1, "size": e.size, "path": e.path,
                        **({"lfs": {"oid": e.sha256, "size": e.size, "pointerSize": 134}}
                           if e.sha256 else {})}
                       for e in _describe(branch) if e.path.startswith(under)]
            self._json(listing, body)

        def _resolve(self, repo_id: str, revision: str, filename: str, authorized: bool,
                     body: bool) -> None:
            branch = self._branch(repo_id, revision, body)
            if branch is None:
                return
            if repo_id in hub.gated and not authorized:
                status = 403 if self.headers.get("Authorization") else 401
                self._error(status, "GatedRepo", "Access to this model is restricted", body)
                return
            file = branch / filename
            entries = _describe(branch)
            commit = _commit_of(entries)
            if not file.is_file():
                self._error(404, "EntryNotFound", f"{filename} does not exist", body,
                            {"X-Repo-Commit": commit})
                return
            data = file.read_bytes()
            entry = next(e for e in entries if e.path == filename)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{entry.git_sha1}"',
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if entry.sha256:
                headers["X-Linked-Etag"] = f'"{entry.sha256}"'
                headers["X-Linked-Size"] = str(entry.size)
            start, status = 0, 200
            requested = self.headers.get("Range")
            if requested and requested.startswith("bytes="):
                start = int(requested[len("bytes="):].split("-")[0])
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            payload = data[start:]
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if not body:
                return
            key = f"{repo_id}/{filename}"
            if key in hub.hold:
                hub.release.wait(timeout=120)
            if key in hub.stall_once and start == 0:
                hub.stall_once.discard(key)
                self.wfile.write(payload[:len(payload) // 2])
                self.wfile.flush()
                hub.release.wait(timeout=120)
                self.close_connection = True
                return
            if key in hub.drop_once and start == 0:
                hub.drop_once.discard(key)
                self.wfile.write(payload[:len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)   # the peer sees the body end early
                return
            self.wfile.write(payload)

        # -- responses -----------------------------------------------------------------------
        def _json(self, value: object, body: bool) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str, body: bool,
                   extra: dict[str, str] | None = None) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the repos' folder (built with --build)")
    parser.add_argument("--build", action="store_true",
                        help="write the test repos (populate) into ROOT first")
    parser.add_argument("--hidden-size", type=int, default=64,
                        help="with --build: the tiny models' width (larger: bigger files)")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.build:
        from tests.hub_repos import build_tiny_models, populate

        populate(args.root, *build_tiny_models(args.root.with_name(args.root.name + "-models"),
                                               args.hidden_size))
    hub = HubServer(args.root, gated={"tiny-org/gated"}, token=TOKEN, port=args.port)
    print(f"HF_ENDPOINT={hub.endpoint}", flush=True)
    seen = 0
    hub.start()
    try:
        while True:
            threading.Event().wait(0.5)
            for r in hub.requests[seen:]:
                print(f"{r.method} {r.path}" + (f" Range: {r.range}" if r.range else ""),
                      flush=True)
            seen = len(hub.requests)
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":
    main()

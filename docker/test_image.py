"""`make test-image`: the built CPU image serves, drains on SIGTERM, and writes nothing but
its volume and /tmp. Not part of `make test` (it needs a built image and buildah):

    make image && python -m pytest -q -p no:cacheprovider docker/test_image.py

IMAGE (default jaxserve:cpu) names the image. The server runs as the image's user with a
fresh host directory as /data and another as /tmp; the container's root filesystem is
snapshotted before and compared after, so a write anywhere else fails the test (the
equivalent of `docker run --read-only -v …:/data --tmpfs /tmp`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from image_harness import (  # noqa: E402
    IMAGE_UID,
    Container,
    Server,
    changed_paths,
    image_exists,
    served_model,
    snapshot,
    stream_chat,
)

IMAGE = os.environ.get("IMAGE", "jaxserve:cpu")
READY_TIMEOUT_S = 900.0
SHUTDOWN_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def container():
    if shutil.which("buildah") is None or not image_exists(IMAGE):
        message = f"needs buildah and the image {IMAGE} (make image)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    started = time.monotonic()
    with Container(IMAGE) as c:
        c.run("true")   # buildah's own mount points exist before the snapshot is taken
        c.before = snapshot(c.root)
        yield c
    print(f"\nmake test-image: {time.monotonic() - started:.0f} s with the container")


@pytest.fixture(scope="module")
def server(container):
    server = Server(container, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
    server.ready_s = server.wait_healthy(READY_TIMEOUT_S)
    yield server
    server.stop()


def test_serves_as_uid_1000_with_the_prebuilt_cpu_kernels(server):
    status = (Path("/proc") / str(server.serving_pid()) / "status").read_text()
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == [str(IMAGE_UID)] * 4, uid_line
    log = server.log()
    # The runtime has no compiler: the kernels built in the image's build stage loaded.
    assert "CPU attention kernel unavailable" not in log and "matmul unavailable" not in log
    print(f"\nready {server.ready_s:.1f} s after launch")


def test_chat_completion(server):
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
        "model": served_model(server.base_url), "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] >= 1


def test_sigterm_mid_stream_finishes_the_stream_and_exits_0(server):
    """SIGTERM (docker stop) arrives after the first streamed token: the running request
    drains to its max_tokens, the stream ends with [DONE], and the process exits 0."""
    signalled = []
    try:
        result = stream_chat(server.base_url, "Count from one to one hundred.", max_tokens=48,
                             on_first_token=lambda: signalled.append(server.terminate()))
    except httpx.HTTPError as e:
        pytest.fail(f"the stream broke ({e!r}); server log:\n{server.log()[-4000:]}")
    assert signalled, "no token arrived before the stream ended"
    assert result["done"] and result["finish_reason"] == "length", result
    assert result["chunks"] >= 10, result
    assert server.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 60) == 0, server.log()[-3000:]


def test_writes_only_the_volume_and_tmp(container, server):
    assert server.process.poll() is not None, "runs after the SIGTERM test"
    compile_cache = container.volume / ".cache" / "jaxserve" / "jax"
    cached = [p for p in compile_cache.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert cached, f"no compilation cache written under the volume ({compile_cache})"
    # buildah run itself adds and removes files under /run (its run-time mount points), which
    # leaves that directory's mtime changed; its contents are compared like every other path.
    after = snapshot(container.root)
    if "run" in after and "run" in container.before:
        after["run"] = container.before["run"][:2] + after["run"][2:]
        container.before["run"] = after["run"]
    changed = changed_paths(container.before, after)
    assert not changed, f"written outside /data and /tmp: {changed[:20]}"


def test_an_arbitrary_uid_in_group_0_can_use_the_volume(container):
    """OpenShift runs the image as a random uid in group 0: HOME (/data) is writable to it
    and the kernels load without a compiler."""
    out = container.run("python3", "-c", (
        "import os, tempfile, pathlib; "
        "p = pathlib.Path.home() / 'probe'; p.write_text('x'); "
        "tempfile.NamedTemporaryFile().close(); "
        "from jaxserve.attention.cpu import loader; print(os.getuid(), loader.register())"),
        user="123456:0")
    uid, library = out.split()
    assert uid == "123456" and library.startswith("/opt/jaxserve/ffi/")

"""Bake a model's start into a CPU image at build time (the Dockerfile's `cpu-baked` stage).

Downloads the model when it is a Hub name (`jaxserve download`), then starts `jaxserve serve`
with the image's serve flags and every bucket compiled before it answers (no background
compilation), sends one chat completion, and stops it with SIGTERM: the XLA compilation
cache, the serialized step executables and the CPU's measured choices land under $HOME
(/data) in the image layer. Standard library only: it runs in the runtime image.

    python3 bake.py --model ORG/NAME -- --max-model-len 2048
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PORT = 8765
READY_TIMEOUT_S = 3600.0


def _is_hub_name(model: str) -> bool:
    return bool(model) and not Path(model).exists() and model.count("/") == 1


def _wait_until_healthy(server: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"bake: jaxserve serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    server.kill()
    sys.exit(f"bake: not ready within {READY_TIMEOUT_S:.0f} s")


def _one_completion() -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=30) as reply:
        model = json.load(reply)["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hello"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)["choices"][0]["message"]["content"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model to bake (empty: the embedded default)")
    parser.add_argument("serve_args", nargs="*", help="flags the image will serve with")
    args = parser.parse_args()
    if _is_hub_name(args.model):
        subprocess.run(["jaxserve", "download", args.model], check=True)
    command = ["jaxserve", "serve", *([args.model] if args.model else []), "--host", "127.0.0.1",
               "--port", str(PORT), "--no-compile-in-background", *args.serve_args]
    started = time.monotonic()
    server = subprocess.Popen(command)
    try:
        _wait_until_healthy(server, started + READY_TIMEOUT_S)
        print(f"bake: ready after {time.monotonic() - started:.1f} s; reply {_one_completion()!r}",
              flush=True)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=300)
    if code != 0:
        sys.exit(f"bake: jaxserve serve exited with {code} after SIGTERM")
    home = Path(os.environ.get("HOME", "/data"))
    size = sum(f.stat().st_size for f in home.rglob("*") if f.is_file())
    print(f"bake: {size / 2**20:.0f} MiB under {home}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

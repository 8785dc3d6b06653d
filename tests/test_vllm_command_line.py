"""A vLLM command line runs unchanged: the quickstart's Compose `command:` (the model replaced
by the default, tensor parallel over simulated devices) starts `jaxserve serve` and answers;
its keys file is re-read on SIGHUP by the real server process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

try:                                    # tests/ as a package or as a plain directory
    from tests.test_api_keys import free_port
except ImportError:
    from test_api_keys import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT = 600

# SmolLM2-135M has 3 KV heads: its tensor-parallel sizes are 1 and 3 (vLLM's line says 2).
COMPOSE_LINE = ["--tensor-parallel-size", "3", "--max-model-len", "4096",
                "--gpu-memory-utilization", "0.9", "--enable-prefix-caching",
                "--max-num-seqs", "256", "--disable-log-requests",
                "--disable-custom-all-reduce", "--pipeline-parallel-size", "1"]


def test_quickstart_compose_line_starts_answers_and_reloads_keys_on_sighup(
        default_gguf_path, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  - key: sk-old\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": REPO,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", *COMPOSE_LINE,
             "--host", "127.0.0.1", "--port", str(port), "--api-keys-file", str(keys)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "not ready:\n" + log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        old = {"Authorization": "Bearer sk-old"}
        r = httpx.post(url + "/v1/completions", headers=old, timeout=120, json={
            "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        log = log_path.read_text()
        assert "--disable-custom-all-reduce: accepted and ignored" in log
        assert "--disable-log-requests is deprecated" in log
        assert "Received request" not in log

        keys.write_text("keys:\n  - key: sk-new\n")
        proc.send_signal(signal.SIGHUP)
        new = {"Authorization": "Bearer sk-new"}
        deadline = time.monotonic() + 30
        while httpx.get(url + "/v1/models", headers=new, timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "SIGHUP did not reload the keys file"
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models", headers=old, timeout=10).status_code == 401
        assert proc.poll() is None          # SIGHUP reloads; it does not stop the server
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

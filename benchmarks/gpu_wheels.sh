#!/usr/bin/env bash
# Download what jaxserve (and benchmarks/gpu_check.sh) import that the GPU image lacks, as
# CPython 3.12 manylinux wheels, into .whl/ (git-ignored; the device call carries it and
# gpu_check.sh installs it there with --no-index). Run here, where PyPI is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
mkdir -p .whl
# the server: fastapi and its stack; gguf and orjson: jaxserve imports; aiohttp and its
# dependencies: benchmarks/bench_serving.py's client.
$py -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  gguf orjson fastapi starlette uvicorn pydantic pydantic_core annotated-types \
  typing-inspection anyio sniffio h11 click \
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna
du -sh .whl

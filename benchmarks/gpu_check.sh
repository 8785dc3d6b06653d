#!/usr/bin/env bash
# One device call's worth of GPU checks (issue 4), meant to finish well inside 8 minutes:
#   1. the kernel tests, compiled by Triton instead of interpreted;
#   2. kernel timings against the jnp reference (8B-class shapes, bf16) with GB/s;
#   3. the whole engine, async scheduling on, on a random-weight Llama-3-8B
#      (--load-format dummy, configs/models/llama-3-8b) through LLM.generate at batch
#      1/64/256: tok/s and mean step ms; then the same with async scheduling off;
#   4. tensor-parallel throughput when several GPUs are present.
# Results land in $OUT (the device tool's output folder) or benchmarks/results/.
#
# Never run yet: no GPU has been lent to a session so far (the step's cuda lowering is
# checked on CPU by tests/test_step_lowering.py). Expect to adjust it on its first run.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

$py -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/gpu_devices.txt"
timeout 180 $py -m pytest -q tests/test_kernels.py 2>&1 | tee "$out/gpu_kernel_tests.log"
timeout 240 $py benchmarks/bench_kernels.py --json "$out/kernels-gpu.json" 2>&1 \
    | tee "$out/gpu_kernels.log"
ngpu=$($py -c "import jax; print(jax.device_count())")
if [ "$ngpu" -gt 1 ]; then
  timeout 120 $py benchmarks/bench_parallel.py --platform gpu --configs tp1 tp2 2>&1 \
      | tee "$out/gpu_parallel.log"
fi

# The engine end to end. The embedded SmolLM2 tokenizer stands in for Llama-3's (its ids
# are a subset of the 8B vocab; generated ids past it detokenize to nothing).
tok=$($py -c "from jaxserve.loader import default_gguf_path; print(default_gguf_path())")
engine_args=(--skip-hf --model configs/models/llama-3-8b --load-format dummy --tokenizer "$tok"
             --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256
             --max-num-batched-tokens 2048 --batch-sizes 1 64 256 --output-len 128)
timeout 300 $py benchmarks/bench_offline.py "${engine_args[@]}" --tag gpu-8b-async 2>&1 \
    | tee "$out/gpu_engine_async.log"
timeout 240 $py benchmarks/bench_offline.py "${engine_args[@]}" --batch-sizes 64 \
    --no-async-scheduling --tag gpu-8b-sync 2>&1 | tee "$out/gpu_engine_sync.log"
cp benchmarks/results/offline_gpu-8b-*.json "$out/" 2>/dev/null || true

# The 8B step's layer loop (issue 28): unrolled (the GPU default) vs the rolled scan vs the
# unrolled step compiled with `jaxserve compile`'s cuBLAS options (which copies every slice).
timeout 300 $py benchmarks/bench_layer_loop.py --model configs/models/llama-3-8b \
    --load-format dummy --tokenizer "$tok" --dtype bfloat16 --tokens 1,64,256 --rounds 3 \
    --variants unrolled,rolled,unrolled-aot --json "$out/layer-loop-gpu.json" 2>&1 \
    | tee "$out/gpu_layer_loop.log"

# Executables compiled on a machine without a GPU (`jaxserve compile --target h200`), carried
# here: load them, run, compare tokens with the JIT-compiled engine, decode tok/s and the HBM
# bandwidth it implies. Build DIR first (CPU box, .venv-gpu):
#   JAX_PLATFORMS=cpu jaxserve compile configs/models/llama-3-8b --target h200 \
#     --max-model-len 2048 --max-num-seqs 8 --max-num-batched-tokens 256 --output aot/llama-3-8b-h200
aot_dir="${AOT_DIR:-aot/llama-3-8b-h200}"
if [ -f "$aot_dir/manifest.json" ]; then
  timeout 300 $py benchmarks/bench_aot_gpu.py --aot-dir "$aot_dir" 2>&1 | tee "$out/gpu_aot.log"
fi

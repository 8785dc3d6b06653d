#!/usr/bin/env bash
# The GPU device check: one prepared call of the device tool, at most 8 minutes (the steps'
# timeouts add up to 480 s; the server runs inside serve_ready + serving), every step
# under its own `timeout`, results merged into $OUT/gpu_check.json and every step's output in
# $OUT/gpu_check.log (the device tool brings back few files). Steps, most important first:
#   engine   the 8B dummy engine (configs/models/llama-3-8b, no tokenizer: --skip-tokenizer-init)
#            with the engine's DEFAULT memory and scheduler flags through bench_offline.py at
#            batch 1/64/256: startup phases, memory plan, tok/s, per-step ms (issue 28: it
#            did not start with default flags);
#   serving  `jaxserve serve` of the same model (a synthetic full-vocabulary tokenizer,
#            benchmarks/synthetic_tokenizer.py) + bench_serving.py at concurrency 64;
#   kernels  bench_kernels.py, decode at 1/16/64/256 sequences x 512/2048/8192 context: ms,
#            bytes moved and GB/s against a copy baseline;
#   hf_peer  HF transformers, eager bf16, same config, batch 1/64/256 (benchmarks/hf_peer.py);
#   scan     the layer loop as lax.scan vs unrolled (benchmarks/scan_vs_unrolled.py);
#   tests    tests/test_kernels.py and tests/test_parity.py, compiled by Triton.
# A second call, when the budget allows: the 8B layer loop unrolled (the GPU default) vs the
# rolled scan vs `jaxserve compile`'s options (benchmarks/bench_layer_loop.py
# --model configs/models/llama-3-8b --load-format dummy --dtype bfloat16 --tokens 1,64,256
# --variants unrolled,rolled,unrolled-untuned,unrolled-cublas): what `jaxserve compile`'s untuned
# Triton tiles (weights read in place) cost against autotuned ones and against cuBLAS (copies).
#
#   benchmarks/gpu_wheels.sh             # here, once: the wheels the GPU image lacks -> .whl/
#   run (device tool): bash benchmarks/gpu_check.sh          carry: [".whl"]
#   CPU dry run of every step (a few minutes):
#     JAX_PLATFORMS=cpu benchmarks/gpu_check.sh --tiny DIR --python .venv/bin/python --out /tmp/o
#
# --tiny DIR: a small model directory (config.json; a tokenizer is not needed), short lengths,
# small batches, Pallas in interpret mode, a few tests: proves the script end to end on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results/gpu-check}"
py=python3
model=configs/models/llama-3-8b
tiny=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tiny) tiny=1; model="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "unknown argument $1 (--tiny DIR, --python PY, --out DIR)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
work=$(mktemp -d)
log="$out/gpu_check.log"
: > "$log"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD"
# The GPU image has no fastapi, gguf, aiohttp...: cp312 wheels (elsewhere the local env has them)
if compgen -G ".whl/*.whl" > /dev/null && \
    $py -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
  timeout 60 $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >> "$log" 2>&1 && export PYTHONPATH="/tmp/site:$PWD"
fi

# step NAME SECONDS CMD...: run CMD under `timeout`, its output into the log, its exit
# status and wall time into steps.jsonl (124: timed out).
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (timeout ${limit}s): $*" >> "$log"
  local start=$SECONDS
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"timeout_s\": $limit}" \
    >> "$work/steps.jsonl"
  echo "=== $name: rc $rc in $((SECONDS - start)) s" >> "$log"
}

if [ -n "$tiny" ]; then
  limits=(--max-model-len 128 --max-num-seqs 4 --max-num-batched-tokens 32)
  offline_limits=("${limits[@]}")
  batches=(1 4); output_len=8; serve_prompts=8; concurrency=4
  vocab=$($py -c "import json; print(json.load(open('$model/config.json'))['vocab_size'])")
  serve_prompt_args=(--random-input-len 16 --token-id-low 1 --token-id-high "$vocab")
  kernel_args=(--interpret --batch 1,2 --context 32,64 --iters 1)
  peer_args=(--batch-sizes 1,2 --output-len 4)
  scan_args=(--layers 2 --hidden 128 --qkv 192 --intermediate 256 --vocab 512
             --batch-sizes 1,4 --iters 2)
  tests_k=(-k "test_kernel_takes_num_seqs_as_a_traced_value or llama-overrides0")
else
  limits=()                               # the flags a user starts with: none
  offline_limits=(--engine-defaults)      # (bench_offline's own defaults are CPU-sized)
  batches=(1 64 256); output_len=128; serve_prompts=256; concurrency=64
  serve_prompt_args=(--random-input-len 128 --token-id-low 1000 --token-id-high 20000)
  kernel_args=(--batch 1,16,64,256 --context 512,2048,8192 --iters 10)
  peer_args=(--batch-sizes 1,64,256 --output-len 128)
  scan_args=(--batch-sizes 1,64,256 --iters 10)
  tests_k=()
fi

step devices 20 $py -c "import jax; print(jax.__version__, jax.devices())"

step engine 105 $py benchmarks/bench_offline.py --model "$model" --load-format dummy \
  --skip-tokenizer-init --skip-hf "${offline_limits[@]}" --batch-sizes "${batches[@]}" \
  --output-len "$output_len" --tag gpu-check --json "$work/engine.json"

# serving: start the server (its own timeout), wait for /health, benchmark, stop it
$py benchmarks/synthetic_tokenizer.py "$model" "$work/tokenizer" >> "$log" 2>&1
port=8765
echo "=== serve: $model" >> "$log"
timeout -k 5 130 $py -m jaxserve.entrypoints.cli serve "$model" --load-format dummy \
  --tokenizer "$work/tokenizer" --port "$port" --host 127.0.0.1 "${limits[@]}" \
  > "$work/server.log" 2>&1 &
server=$!
step serve_ready 75 $py -c "
import time, urllib.request
while True:
    try:
        urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2); break
    except Exception:
        time.sleep(1)
"
step serving 50 $py benchmarks/bench_serving.py --base-url "http://127.0.0.1:$port" \
  --num-prompts "$serve_prompts" --max-concurrency "$concurrency" "${serve_prompt_args[@]}" \
  --random-output-len "$output_len" --ignore-eos --save-result --result-dir "$work" --result-filename serving.json
kill "$server" 2>/dev/null
wait "$server" 2>/dev/null
tail -n 40 "$work/server.log" >> "$log"

step kernels 40 $py benchmarks/bench_kernels.py --mode decode --skip-reference \
  "${kernel_args[@]}" --json "$work/kernels.json"
step hf_peer 50 $py benchmarks/hf_peer.py "$model" "$work/hf_peer.json" "${peer_args[@]}"
step scan 30 $py benchmarks/scan_vs_unrolled.py "$work/scan.json" "${scan_args[@]}"
step tests 110 $py -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_parity.py \
  "${tests_k[@]}"

# One JSON: each step's status and its results (missing when the step wrote none).
$py - "$work" "$out/gpu_check.json" <<'EOF'
import json, pathlib, sys
work, path = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
result = {"steps": steps, "ok": all(s["rc"] == 0 for s in steps)}
for name in ("engine", "serving", "kernels", "hf_peer", "scan"):
    file = work / f"{name}.json"
    result[name] = json.loads(file.read_text()) if file.is_file() else None
path.write_text(json.dumps(result, indent=1, default=str) + "\n")
print(f"wrote {path}: " + ", ".join(f"{s['step']} rc {s['rc']} ({s['seconds']} s)"
                                     for s in steps))
EOF
rm -rf "$work"

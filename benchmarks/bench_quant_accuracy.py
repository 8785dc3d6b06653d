"""Accuracy only of quantized modes vs float32: bench_quant.py's windows, prompts and metrics
(teacher-forced KL / top-1 / perplexity, greedy-128 agreement), smaller engines
(max_num_seqs 8, 64 MiB KV), no tok/s: the full bench's fp8 rows crawl on CPU (write_kv).

    PYTHONPATH=. python benchmarks/bench_quant_accuracy.py OUT.json float32:fp8,int8:int8
    PYTHONPATH=. python benchmarks/bench_quant_accuracy.py OUT.json bfloat16:auto,int8-bf16:auto

A mode is WEIGHTS:KV_CACHE_DTYPE; WEIGHTS is float32, bfloat16 (bf16 compute, the matrix-unit
path), int8 (int8 weights, float32 compute) or int8-bf16 (int8 weights, bf16 compute).
Writes the rows (the float32 baseline first, always dtype=float32) to OUT.json after each mode.
"""
import gc
import json
import sys
import time

from benchmarks.bench_quant import PROMPTS, TEXT, WINDOW, compare, log_softmax, mode_name
from jaxserve import LLM, SamplingParams

WEIGHTS = {"float32": (None, "float32"), "bfloat16": (None, "bfloat16"),
           "int8": ("int8", "float32"), "int8-bf16": ("int8", "bfloat16")}
modes = [(None, "float32", "auto")] + [(*WEIGHTS[w], kv) for w, kv in
                                       (m.split(":") for m in sys.argv[2].split(","))]
windows = base = None
rows = []
for quant, dtype, kv in modes:
    t = time.time()
    llm = LLM(None, quantization=quant, dtype=dtype, kv_cache_dtype=kv, max_model_len=256,
              max_num_seqs=8,
              max_num_batched_tokens=128, kv_cache_memory_bytes=64 << 20)
    if windows is None:
        ids = llm.get_tokenizer().encode(TEXT.read_text())
        windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)]
    lp = [log_softmax(llm.llm_engine.prompt_logits(w)) for w in windows]
    t_tf = time.time() - t
    greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    cont = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    if base is None:
        base = (lp, cont)
    r = compare(windows, base[0], lp, base[1], cont)
    setup = llm.llm_engine.engine_core.setup
    r |= {"mode": mode_name(quant, kv) + ("" if dtype == "float32" else f" ({dtype})"),
          "dtype": dtype, "quantization": quant, "kv_cache_dtype": kv,
          "kv_bytes_per_token": setup.kv_plan.bytes_per_block // setup.kv_plan.block_size,
          "backend": setup.runner.model.backend.name,
          "seconds_setup_and_teacher_forced": round(t_tf), "seconds_total": round(time.time() - t)}
    rows.append(r)
    print(json.dumps(r), flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)
    del llm, setup
    gc.collect()

"""One engine of the jaxserve tree on PYTHONPATH: offline 64 x 128 and 1 x 128 greedy tok/s as JSON.

Run it alternately with PYTHONPATH set to two checkouts (a before and an after) to compare them
in one run: `PYTHONPATH=../old python benchmarks/before_after_offline.py before -`, then
`PYTHONPATH=. python benchmarks/before_after_offline.py after none` (quantization, or - for unset)."""
import json
import sys
import time

from jaxserve import LLM, SamplingParams

tree, quant = sys.argv[1], sys.argv[2]
kw = dict(dtype="bfloat16", max_model_len=512, compile_in_background=False)
if quant != "-":
    kw["quantization"] = quant
llm = LLM(**kw)
prompts = [f"Write a story about the number {i}." for i in range(64)]
sp = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True))  # warm
out = {}
for n in (64, 1):
    t = time.perf_counter()
    res = llm.generate(prompts[:n], sp)
    dt = time.perf_counter() - t
    out[n] = sum(len(r.outputs[0].token_ids) for r in res) / dt
print(json.dumps({"tree": tree, "tok_s": out}))

"""The measured accuracy cost of each quantized mode, quoted in the startup log.

benchmarks/bench_quant.py measures every mode (weights x KV dtype) against float32 and
writes measured_cost.json next to this file (and benchmarks/results/quant-cpu.json), so
nobody trades accuracy silently: `setup_model` logs the row of the mode it runs.
"""

from __future__ import annotations

import json
from pathlib import Path

MEASURED = Path(__file__).with_name("measured_cost.json")


def measured_cost(quantization: str | None, kv_cache_dtype: str) -> str | None:
    """One log line for a quantized mode (None for float32 weights and KV, or unmeasured)."""
    if quantization is None and kv_cache_dtype in ("auto", "float32"):
        return None
    kv = "auto" if kv_cache_dtype == "float32" else kv_cache_dtype.replace("fp8_e4m3", "fp8")
    try:
        report = json.loads(MEASURED.read_text())
    except (OSError, ValueError):
        return f"quantization {quantization}, KV {kv_cache_dtype}: accuracy cost not measured"
    for row in report.get("modes", []):
        if row.get("quantization") == quantization and row.get("kv_cache_dtype") == kv:
            greedy = row.get("greedy_128_agreement")   # absent: teacher-forced only
            greedy = "not measured" if greedy is None else f"{greedy:.1%}"
            return (f"measured cost of {row['mode']} on {report['model']} ({report['platform']}; "
                    f"benchmarks/bench_quant.py): next-token KL vs float32 mean "
                    f"{row['kl_mean']:.2e} / p99 {row['kl_p99']:.2e}, top-1 agreement "
                    f"{row['top1_agreement']:.1%}, greedy 128-token agreement "
                    f"{greedy}, perplexity {row['perplexity']:.2f}")
    return f"quantization {quantization}, KV {kv_cache_dtype}: accuracy cost not measured"

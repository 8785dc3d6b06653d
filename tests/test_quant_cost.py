"""The startup log quotes a quantized mode's measured cost (jaxserve/quantization/cost.py)."""

from __future__ import annotations

import json

import pytest

from jaxserve.quantization import cost

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`


def test_measured_cost_quotes_the_modes_row_and_says_when_unmeasured(tmp_path, monkeypatch):
    table = {"model": "m", "platform": "cpu", "modes": [
        {"mode": "weights=int8 kv=float32", "quantization": "int8", "kv_cache_dtype": "auto",
         "kl_mean": 1.5e-3, "kl_p99": 2e-2, "top1_agreement": 0.975,
         "greedy_128_agreement": 0.5, "perplexity": 7.25}]}
    path = tmp_path / "measured_cost.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(cost, "MEASURED", path)
    line = cost.measured_cost("int8", "auto")
    assert "top-1 agreement 97.5%" in line and "1.50e-03" in line and "7.25" in line
    assert "not measured" in cost.measured_cost("gguf", "fp8")
    assert cost.measured_cost(None, "float32") is None

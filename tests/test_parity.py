"""Parity with Hugging Face transformers (torch, CPU, float32): logits and greedy tokens."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import transformers

from jaxserve import LLM, SamplingParams
from tests import precision
from tests.conftest import TINY_ARCHS
from tests.hf_reference import hf_greedy, hf_logits, torch_model_from_weights

logger = logging.getLogger(__name__)

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog.",
         "Paged attention stores the key-value cache in fixed-size blocks, and continuous "
         "batching lets new requests join.",
         "def add(a, b):\n    return a + b\n# Numbers like 12345"]
NEW_TOKENS = 32


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _check_parity(llm: LLM, hf_model, prompts: list[list[int]], logits_tol: float) -> float:
    assert len({len(p) for p in prompts}) == len(prompts), "prompts must differ in length"
    worst = 0.0
    for ids in prompts:
        ours = llm.llm_engine.prompt_logits(ids)
        diff = float(np.abs(ours - hf_logits(hf_model, ids)).max())
        worst = max(worst, diff)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)     # one batch, all together
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, NEW_TOKENS)
    assert worst <= logits_tol
    return worst


# Sliding windows of 8 tokens: shorter than all prompts but the first, and far shorter than
# prompt + 32 generated tokens (max_model_len 128 is not capped at the window).
SLIDING = [("mistral", {"sliding_window": 8}),
           ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})]


# The llama family's engine-tier check is the plain tiny Llama (make test-engine).
@pytest.mark.parametrize("arch, overrides", [
    *(pytest.param(a, {}, marks=pytest.mark.engine) if a == "llama" else (a, {})
      for a in TINY_ARCHS),
    ("llama", {"attention_bias": True}), *SLIDING])
def test_tiny_model_logits_and_greedy_tokens_match_hf(make_tiny_model, arch, overrides):
    model_dir = make_tiny_model(arch, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              kv_cache_memory_bytes=2 << 20, **precision.EXACT)
    window = overrides.get("sliding_window")
    if window:
        windows = llm.llm_engine.engine_core.setup.arch.layer_windows
        assert windows == ((8, 8) if arch == "mistral" else (0, 8))
        assert llm.llm_engine.engine_core.setup.max_model_len == 128
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    worst = _check_parity(llm, hf, prompts, logits_tol=precision.LOGITS_TOL_TINY)
    logger.warning("%s: max |logits - HF| = %.2e", arch, worst)


def test_default_smollm2_logits_and_greedy_tokens_match_hf(default_llm):
    from jaxserve.loader import load_model

    loaded = load_model(None)
    hf = torch_model_from_weights(loaded.hf_config, loaded.weights)
    tok = default_llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}],
                                       add_generation_prompt=True, tokenize=True)
               for t in TEXTS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    worst = _check_parity(default_llm, hf, prompts, logits_tol=precision.LOGITS_TOL_DEFAULT)
    logger.warning("SmolLM2-135M: max |logits - HF| = %.2e", worst)


def test_unrolled_and_per_layer_loops_give_the_scans_logits(make_tiny_model):
    """GPUs run the layers unrolled, CPUs as a scan, and per-layer buffers are the third
    layer loop of the execution plan (models/execution_plan.py): the same parameters and
    per-layer inputs (windows, layer index) give the same logits."""
    import dataclasses

    from jaxserve.config import EngineConfig
    from jaxserve.engine.model_setup import setup_model
    from jaxserve.models.decoder import per_layer_weights
    from jaxserve.models.execution_plan import LayerLoop

    model = make_tiny_model("qwen2", use_sliding_window=True, sliding_window=8,
                            max_window_layers=1, num_hidden_layers=3)
    config = EngineConfig.from_kwargs(model=str(model), dtype="float32", max_model_len=64,
                                      max_num_seqs=2, max_num_batched_tokens=16,
                                      attention_backend="reference",
                                      kv_cache_memory_bytes=1 << 20, load_format="dummy")
    runner = setup_model(config, warmup=False).runner
    assert runner.plan.layer_loop is LayerLoop.SCANNED
    ids = list(range(3, 23))                     # 20 tokens: past the 8-token window
    rolled = runner.prompt_logits(ids, [0, 1])
    assert np.abs(rolled).max() > 0
    base, stacked = runner.model, runner.params
    for loop in (LayerLoop.UNROLLED, LayerLoop.PER_LAYER):
        runner.model = base.with_plan(dataclasses.replace(base.plan, layer_loop=loop))
        runner.params = {"params": per_layer_weights(stacked["params"])} \
            if loop is LayerLoop.PER_LAYER else stacked
        runner._prompt_logits_fns.clear()
        np.testing.assert_allclose(runner.prompt_logits(ids, [0, 1]), rolled,
                                   rtol=1e-5, atol=1e-5, err_msg=loop.value)

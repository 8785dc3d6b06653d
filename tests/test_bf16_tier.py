"""The bf16 tier: what bfloat16 compute promises against the same model in float32.

The exactness tests pin float32 (tests/precision.py); these pin bfloat16, so they run the bf16
path on every machine (oneDNN emulates bf16 products where the CPU has no bf16 units), with
bounds that hold anywhere: teacher-forced top-1 agreement and a bounded logit error on the
parity prompts. (Greedy identity with float32, or across batch compositions, is not among
them: bf16 rounding differs with the GEMM's blocking, so near-ties may flip.)
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxserve import LLM
from tests import precision
from tests.test_parity import TEXTS

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def default_llm_bf16(default_gguf_path):
    return LLM(None, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
               kv_cache_memory_bytes=16 << 20, quantization="none", **precision.BF16)


def _chat_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}],
                                       add_generation_prompt=True, tokenize=True) for t in TEXTS]
    return [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]


def test_bf16_default_model_agrees_with_float32_teacher_forced(default_llm, default_llm_bf16):
    assert np.dtype(default_llm.llm_engine.engine_core.setup.dtype).name == "float32"
    assert np.dtype(default_llm_bf16.llm_engine.engine_core.setup.dtype).name == "bfloat16"
    agree = total = 0
    worst = 0.0
    for ids in _chat_prompts(default_llm):
        exact = default_llm.llm_engine.prompt_logits(ids)
        bf16 = default_llm_bf16.llm_engine.prompt_logits(ids)
        assert bf16.shape == exact.shape and np.isfinite(bf16).all()
        agree += int((bf16.argmax(-1) == exact.argmax(-1)).sum())
        total += len(ids)
        spread = exact.std(axis=-1, keepdims=True)
        worst = max(worst, float((np.abs(bf16 - exact) / spread).max()))
    logger.warning("SmolLM2 bf16 vs float32: top-1 %d/%d, max |diff| / spread %.3f",
                   agree, total, worst)
    assert agree / total >= precision.BF16_MIN_TOP1, (agree, total)
    assert worst <= precision.BF16_MAX_LOGIT_ERR, worst


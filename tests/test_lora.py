"""Multi-LoRA serving (jaxserve/lora): parity with HF + PEFT, batches mixing adapters, slots
swapped without compiles, bad adapters rejected at load."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import transformers

from jaxserve import LLM, LoRARequest, SamplingParams
from tests.hf_reference import hf_greedy, hf_logits
from tests.lora_adapters import ALL_TARGETS, ATTENTION_TARGETS, make_peft_adapter
from tests.test_parity import TEXTS

logger = logging.getLogger(__name__)

NEW_TOKENS = 32
GEMMA3 = ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 24,
                               "sliding_window": 8, "tie_word_embeddings": True})
QWEN3_MOE = ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64, "head_dim": 16,
                                "norm_topk_prob": True, "tie_word_embeddings": True})
# family -> (make_tiny_model args, targets its adapters adapt)
FAMILIES = {"llama": (("llama", {}), ALL_TARGETS),
            "qwen3": (("qwen3", {}), ALL_TARGETS),
            "gemma3": (GEMMA3, ALL_TARGETS),
            "qwen3_moe": (QWEN3_MOE, ATTENTION_TARGETS)}   # expert MLPs: a clear error instead


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tiny_llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
               kv_cache_memory_bytes=2 << 20, enable_lora=True, max_lora_rank=16, **kwargs)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_case(request, make_tiny_model, tmp_path_factory):
    """One engine per family with two random adapters: rank 8 (alpha 24, rsLoRA) and rank 16
    (alpha 8); the PEFT models are the references."""
    (arch, overrides), targets = FAMILIES[request.param]
    model_dir = make_tiny_model(arch, **overrides)
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    adapters = []
    for i, (rank, alpha, rslora) in enumerate(((8, 24, True), (16, 8, False))):
        path = root / f"r{rank}"
        hf = make_peft_adapter(model_dir, path, rank=rank, alpha=alpha, targets=targets,
                               seed=i, use_rslora=rslora)
        adapters.append((LoRARequest(f"r{rank}", i + 1, str(path)), hf))
    llm = _tiny_llm(model_dir, max_loras=2)
    return request.param, model_dir, llm, adapters


def test_logits_and_greedy_tokens_match_hf_peft_for_each_family(family_case):
    name, model_dir, llm, adapters = family_case
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS[1:3]]
    worst = 0.0
    for lora, hf in adapters:
        for ids in prompts:
            ours = llm.llm_engine.prompt_logits(ids, lora)
            ref = hf_logits(hf, ids)
            if ids is prompts[0]:   # the adapter must matter, or the test proves nothing
                with hf.disable_adapter():
                    assert np.abs(ref - hf_logits(hf, ids)).max() > 1e-2
            worst = max(worst, float(np.abs(ours - ref).max()))
    # One batch: every prompt under both adapters and the base model together.
    jobs = [(ids, lora, hf) for ids in prompts for lora, hf in adapters]
    outs = llm.generate([j[0] for j in jobs], _greedy(), use_tqdm=False,
                        lora_request=[j[1] for j in jobs])
    for (ids, _, hf), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW_TOKENS)
    logger.warning("%s: max |logits - HF+PEFT| = %.2e", name, worst)
    assert worst <= 1e-4


def test_moe_expert_targets_are_a_clear_error(make_tiny_model, tmp_path):
    from jaxserve.lora.peft_loader import load_peft_adapter
    from jaxserve.models.registry import family_for, read_arch

    arch_name, overrides = QWEN3_MOE
    model_dir = make_tiny_model(arch_name, **overrides)
    make_peft_adapter(model_dir, tmp_path, rank=4, alpha=8,
                      targets=["q_proj", "gate_proj", "up_proj", "down_proj"])
    arch = read_arch(transformers.AutoConfig.from_pretrained(model_dir))
    with pytest.raises(ValueError, match="expert MLP adapters are not supported"):
        load_peft_adapter(str(tmp_path), family_for(arch.architecture), arch, 16)

"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) against Hugging Face, offline.

One tiny random Llama engine whose prompt-logprobs gather holds 16 positions per step, so
a 70-token prompt is prefilled in several chunks; the HF model has the same weights.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from tests.hf_reference import hf_logits

# Shared with tests/test_prompt_logprobs_server.py, so the server reuses the compiled steps.
ENGINE_KWARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                     max_prompt_logprobs_per_step=16, kv_cache_memory_bytes=4 << 20)
NUM_TOP = 5


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=length).tolist()


@pytest.fixture(scope="module")
def model_dir(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()


def hf_prompt_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """[len - 1, V]: row i is HF's log-softmax of the logits that predict prompt token i + 1."""
    logits = torch.from_numpy(hf_logits(hf_model, ids)[:-1]).double()
    return torch.log_softmax(logits, -1).numpy()


def assert_matches_hf(prompt_logprobs, ids: list[int], expected: np.ndarray, num_top: int):
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry, row, token = prompt_logprobs[i], expected[i - 1], ids[i]
        assert abs(entry[token].logprob - row[token]) <= 1e-4, i
        assert entry[token].rank == 1 + int(np.sum(row > row[token])), i
        top = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank <= num_top)
        assert [tid for _, tid in top] == np.argsort(-row)[:num_top].tolist(), i
        assert set(entry) == {token, *np.argsort(-row)[:num_top].tolist()}
        assert all(abs(lp.logprob - row[tid]) <= 1e-4 for tid, lp in entry.items())


def test_prompt_logprobs_over_several_prefill_chunks_match_hf(llm, hf):
    ids = _prompt(70, seed=0)          # > 4 chunks of 16 prompt-logprobs positions
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                              prompt_logprobs=NUM_TOP), use_tqdm=False)[0]
    assert_matches_hf(out.prompt_logprobs, ids, hf_prompt_logprobs(hf, ids), NUM_TOP)
    assert out.prompt_logprobs[1][ids[1]].decoded_token == llm.get_tokenizer().decode([ids[1]])
    assert len(out.outputs[0].token_ids) == 3


def test_cached_prefix_is_recomputed_so_no_position_is_missing(llm, hf):
    ids = _prompt(50, seed=1)
    first = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    again = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32   # the cache works
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0, "a prompt_logprobs request skips the prefix cache"
    assert_matches_hf(out.prompt_logprobs, ids, hf_prompt_logprobs(hf, ids), 0)


def test_mixed_batch_compiles_nothing_and_max_tokens_zero_is_prefill_only(llm, hf):
    prompts = [_prompt(n, seed=10 + n) for n in (40, 23, 9, 61, 2)]
    params = [SamplingParams(max_tokens=0, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=8, logprobs=2),
              SamplingParams(temperature=0.8, seed=1, max_tokens=5, prompt_logprobs=NUM_TOP,
                             n=2),
              SamplingParams(max_tokens=4, prompt_logprobs=1),
              SamplingParams(max_tokens=0, prompt_logprobs=0)]
    compiles: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert outs[1].prompt_logprobs is None
    for i in (0, 2, 3, 4):
        assert_matches_hf(outs[i].prompt_logprobs, prompts[i],
                          hf_prompt_logprobs(hf, prompts[i]), params[i].prompt_logprobs)
    for i in (0, 4):
        [c] = outs[i].outputs
        assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
    assert [len(c.token_ids) for c in outs[2].outputs] == [5, 5]


def test_prompt_logprobs_turned_off_is_a_clear_error(model_dir):
    from jaxserve.runner.input_batch import InputBatch

    batch = InputBatch(2, 64, 16, 4, prompt_logprobs_cap=0)
    with pytest.raises(ValueError, match="max_prompt_logprobs_per_step=0"):
        batch.check(SamplingParams(prompt_logprobs=1))

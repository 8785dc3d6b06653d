"""SamplingParams: vLLM's defaults, normalizations and rejections (with their messages)."""

from __future__ import annotations

import math

import pytest

from jaxserve.sampling_params import SamplingParams, SamplingType

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0,
                                                                           0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logit_bias is None
    assert p.detokenize and p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.sampling_type == SamplingType.RANDOM and p.user_set == frozenset()


def test_normalizations():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop_token_ids=[5, 3, 5]).stop_token_ids == [5, 3]
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(temperature=0.001).temperature == 0.01     # vLLM's floor
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(n=3, best_of=3).best_of == 3
    assert SamplingParams(n=2, temperature=0.0).n == 2              # greedy n > 1 allowed


def test_greedy_resets_the_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    assert p.sampling_type == SamplingType.GREEDY and p.is_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_logit_bias_keys_become_ints_and_values_are_clamped():
    p = SamplingParams(logit_bias={"17": 250.0, 3: -1e9, 4: 2.5})
    assert p.logit_bias == {17: 100.0, 3: -100.0, 4: 2.5}


REJECTED = [
    (dict(n=0), "n must be at least 1, got 0"),
    (dict(n=1.5), "n must be an integer"),
    (dict(n=2, best_of=3), "best_of must be None or equal to n=2"),
    (dict(temperature=-0.1), "temperature must be non-negative, got -0.1"),
    (dict(temperature=math.inf), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\], got 1.01"),
    (dict(top_k=-2), r"top_k must be 0 \(disable\), or at least 1, got -2"),
    (dict(top_k=2.5), "top_k must be an integer, got float"),
    (dict(min_p=-0.01), r"min_p must be in \[0, 1\], got -0.01"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(presence_penalty=-2.1), r"presence_penalty must be in \[-2, 2\], got -2.1"),
    (dict(frequency_penalty=-3.0), r"frequency_penalty must be in \[-2, 2\], got -3.0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be greater than zero"),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be less than or equal to "
                                         "max_tokens=10, got 20"),
    (dict(logprobs=-1), "logprobs must be non-negative, got -1"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be non-negative, got -1"),
    (dict(max_tokens=0, logprobs=1), r"max_tokens must be at least 1, got 0 \(0 only with "
                                      "prompt_logprobs"),
    (dict(stop=["ok", ""]), "stop cannot contain an empty string"),
    (dict(stop="x", detokenize=False), "stop strings are only supported when detokenize"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids must contain only integers"),
    (dict(seed=1.5), "seed must be an integer, got float"),
    (dict(seed="7"), "seed must be an integer, got str"),
    (dict(logit_bias={"a": 1.0}), "cannot be converted to integer token IDs: 'a'"),
    (dict(logit_bias={1: math.nan}), "logit_bias values must be numbers in"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "at most 300 entries, got 301"),
]


def test_max_tokens_zero_is_prefill_only_with_prompt_logprobs():
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


@pytest.mark.parametrize("kwargs,message", REJECTED, ids=[m[:40] for _, m in REJECTED])
def test_rejects_what_vllm_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_verify_checks_engine_limits():
    SamplingParams(logprobs=20).verify(max_logprobs=20, max_model_len=128)
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater "
                                         "than max allowed: 20"):
        SamplingParams(logprobs=21).verify(max_logprobs=20, max_model_len=128)
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21, which is greater "
                                         "than max allowed: 20"):
        SamplingParams(prompt_logprobs=21).verify(max_logprobs=20, max_model_len=128)
    with pytest.raises(ValueError, match="min_tokens must be at most max_model_len=128"):
        SamplingParams(min_tokens=200, max_tokens=None).verify(20, 128)
    with pytest.raises(ValueError, match=r"token_id\(s\) \[1000\] in logit_bias"):
        SamplingParams(logit_bias={1000: 1.0}).verify(20, 128, vocab_size=1000)
    with pytest.raises(ValueError, match=r"token_id\(s\) \[-3\] in stop_token_ids"):
        SamplingParams(stop_token_ids=[-3]).verify(20, 128, vocab_size=1000)


GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                     "repetition_penalty": 1.1, "max_new_tokens": 7, "do_sample": True}


def test_generation_config_fills_only_unset_fields():
    p = SamplingParams(temperature=1.0, top_k=5)
    p.update_from_generation_config(GENERATION_CONFIG)
    assert (p.temperature, p.top_k) == (1.0, 5)               # set by the user, even = default
    assert (p.top_p, p.min_p, p.repetition_penalty) == (0.9, 0.05, 1.1)
    assert p.max_tokens == 16                                  # max_new_tokens is not read
    q = SamplingParams()
    q.update_from_generation_config(GENERATION_CONFIG)
    assert (q.temperature, q.top_p, q.top_k, q.min_p, q.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1)


def test_generation_config_keeps_greedy_requests_greedy():
    p = SamplingParams(temperature=0.0)
    p.update_from_generation_config(GENERATION_CONFIG)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert p.repetition_penalty == 1.1                          # not a filter: still applied


def test_generation_config_values_are_validated():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams().update_from_generation_config({"top_p": 1.5})


def test_clone_is_deep_and_keeps_user_set():
    p = SamplingParams(temperature=0.5, stop=["a"], logit_bias={1: 2.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0}
    assert q.user_set == {"temperature"} and q.temperature == 0.5

"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): offline against Hugging Face,
and on the server (echo + logprobs, echo with max_tokens 0, the prompt_logprobs field,
/tokenizer_info) against the offline engine.

One tiny random Llama engine whose prompt-logprobs gather holds 16 positions per step, so
a 70-token prompt is prefilled in several chunks; the HF model has the same weights. The
server runs the same engine configuration (its steps come from the compilation cache).
"""

from __future__ import annotations

import json

import httpx
import jax
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from tests import precision
from tests.hf_reference import hf_logits
from tests.test_server import ServerProcess

# The server below runs the same configuration, so it reuses the compiled steps.
ENGINE_KWARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                     max_prompt_logprobs_per_step=16, kv_cache_memory_bytes=4 << 20,
                     **precision.EXACT)
NUM_TOP = 5
MAX_LOGPROBS = 20      # the engine default


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

    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
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


# -- the server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(model_dir, tmp_path_factory):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_KWARGS.items()]
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("server") / "server.log", *flags,
                        "--enable-tokenizer-info-endpoint")
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            yield client
    finally:
        assert srv.stop() == 0, srv.log_tail()


def _offline_prompt_logprobs(llm, ids: list[int], num_top: int):
    return llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=num_top),
                        use_tqdm=False)[0].prompt_logprobs


def test_echo_with_logprobs_reports_the_prompt_then_the_completion(llm, http):
    ids = _prompt(37, seed=3)
    body = http.post("/v1/completions", json={
        "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
        "ignore_eos": True}).json()
    [choice] = body["choices"]
    lp = choice["logprobs"]
    expected = _offline_prompt_logprobs(llm, ids, 2)
    tok = llm.get_tokenizer()
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - expected[i][ids[i]].logprob) <= 1e-4
        # Token texts are the keys: undecodable byte tokens ("\ufffd") may share one.
        assert lp["tokens"][i] in lp["top_logprobs"][i] and len(lp["top_logprobs"][i]) <= 3
    assert all(v is not None for v in lp["token_logprobs"][len(ids):])   # generated ones
    assert lp["text_offset"][:2] == [0, len(tok.decode([ids[0]]))]
    assert choice["text"].startswith(tok.decode(ids))
    assert choice["prompt_logprobs"][0] is None
    assert set(choice["prompt_logprobs"][1]) >= {str(ids[1])}


def test_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(llm, http):
    ids = _prompt(25, seed=6)
    expected = _offline_prompt_logprobs(llm, ids, 1)
    with http.stream("POST", "/v1/completions", json={
            "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True,
            "temperature": 0}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])["choices"][0]
    assert first["text"].startswith(llm.get_tokenizer().decode(ids))
    token_logprobs = first["logprobs"]["token_logprobs"]
    assert token_logprobs[0] is None
    assert all(abs(token_logprobs[i] - expected[i][ids[i]].logprob) <= 1e-4
               for i in range(1, len(ids)))


def test_echo_with_max_tokens_zero_returns_only_the_prompt(llm, http):
    ids = _prompt(20, seed=4)
    text = llm.get_tokenizer().decode(ids)
    body = http.post("/v1/completions", json={
        "prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0}).json()
    [choice] = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    encoded = llm.get_tokenizer().encode(text)
    assert len(choice["logprobs"]["tokens"]) == len(encoded)
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert all(v is not None for v in choice["logprobs"]["token_logprobs"][1:])
    # Without logprobs: the prompt alone, and no logprobs reported.
    body = http.post("/v1/completions", json={"prompt": text, "echo": True,
                                              "max_tokens": 0}).json()
    assert body["choices"][0]["text"] == text
    assert body["choices"][0]["logprobs"] is None
    assert body["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_field_on_completions_and_chat(llm, http):
    ids = _prompt(30, seed=5)
    expected = _offline_prompt_logprobs(llm, ids, 3)
    body = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2,
                                              "prompt_logprobs": 3}).json()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        assert set(got[i]) == {str(t) for t in expected[i]}
        for tid, lp in expected[i].items():
            entry = got[i][str(tid)]
            assert entry["rank"] == lp.rank and entry["decoded_token"] == lp.decoded_token
            assert abs(entry["logprob"] - lp.logprob) <= 1e-4
    body = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2,
        "prompt_logprobs": 1}).json()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 5
    assert all(1 <= len(e) <= 2 for e in body["prompt_logprobs"][1:])


@pytest.mark.parametrize("payload, message", [
    ({"prompt_logprobs": -2}, "must be a positive value or -1"),
    ({"prompt_logprobs": -1}, "whole vocabulary) is not supported"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "greater than max allowed: 20"),
    ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
])
def test_bad_prompt_logprobs_requests_are_400s_in_openai_shape(http, payload, message):
    response = http.post("/v1/completions", json={"prompt": "hello", **payload})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_tokenizer_info_describes_the_served_tokenizer(llm, http):
    info = http.get("/tokenizer_info").json()
    tok = llm.get_tokenizer()
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] == type(tok).__name__
    tokens = http.post("/tokenize", json={"prompt": "hello world",
                                          "add_special_tokens": False}).json()["tokens"]
    assert tokens == tok.encode("hello world", add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "hello world"


def test_lm_eval_loglikelihoods_equal_the_offline_prompt_logprobs(llm, http, monkeypatch):
    """lm-eval's `local-completions` (echo + logprobs, remote tokenizer) end to end."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from tests.test_server import ROOT

    monkeypatch.chdir(ROOT)                         # the task YAMLs name their data from it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{http.base_url}/v1/completions", "model": "tiny",
                    "tokenizer_backend": "remote", "num_concurrent": 2, "max_retries": 1},
        tasks=["jaxserve_smoke_mc", "jaxserve_smoke_gen"], limit=3, log_samples=True,
        task_manager=TaskManager(include_path=str(ROOT / "tests" / "data" / "lm_eval")))
    assert 0.0 <= results["results"]["jaxserve_smoke_mc"]["acc,none"] <= 1.0
    assert len(results["samples"]["jaxserve_smoke_gen"]) == 3
    tok = llm.get_tokenizer()
    for sample in results["samples"]["jaxserve_smoke_mc"]:
        for (context, continuation), [(loglikelihood, _)] in zip(sample["arguments"],
                                                                sample["resps"]):
            ids = tok.encode(context + continuation, add_special_tokens=False)
            start = len(tok.encode(context, add_special_tokens=False))
            entries = _offline_prompt_logprobs(llm, ids, 0)
            expected = sum(entries[i][ids[i]].logprob for i in range(start, len(ids)))
            assert abs(loglikelihood - expected) <= 1e-3

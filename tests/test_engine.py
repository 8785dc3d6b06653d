"""End-to-end engine behaviour on a tiny random Llama: batching, caching, preemption, errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests import precision

pytestmark = pytest.mark.engine      # the engine tier: every test here (make test-engine)

PROMPT = [11, 23, 98, 421, 77, 310, 248, 9, 150, 42, 61, 331, 88, 12, 7, 91, 64, 5]


def _greedy(max_tokens=20, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1,
                          **kw)


def _others(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 500, size=int(rng.integers(3, 40))).tolist() for _ in range(count)]


def _tokens_and_logprobs(out):
    c = out.outputs[0]
    lps = [entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs)]
    return c.token_ids, np.array(lps)


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    return LLM(str(make_tiny_model("llama")), max_model_len=256, max_num_seqs=32,
               max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20, **precision.EXACT)


def test_greedy_request_is_identical_alone_in_a_batch_and_after_a_prefix_hit(llm):
    alone = llm.generate([PROMPT], _greedy(), use_tqdm=False)[0]
    batch = llm.generate(_others(8) + [PROMPT] + _others(8, seed=1), _greedy(),
                         use_tqdm=False)[8]
    cached = llm.generate([PROMPT], _greedy(), use_tqdm=False)[0]
    assert cached.num_cached_tokens >= 16, "the second run should hit the prefix cache"
    ref_tokens, ref_lps = _tokens_and_logprobs(alone)
    for other in (batch, cached):
        tokens, lps = _tokens_and_logprobs(other)
        assert tokens == ref_tokens
        # XLA's CPU dots are not bitwise batch-invariant (row results depend on M), so
        # logprobs agree to a tolerance, not bit for bit.
        assert np.max(np.abs(lps - ref_lps)) <= 1e-4


def test_preempted_request_resumes_with_identical_tokens(make_tiny_model, llm):
    reference = llm.generate([PROMPT], _greedy(40), use_tqdm=False)[0]
    # 12 blocks of 16 tokens: 6 sequences of ~60 tokens cannot all fit, so the newest are
    # preempted and recomputed.
    small = LLM(str(make_tiny_model("llama")), max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=64, num_gpu_blocks_override=12, **precision.EXACT)
    engine = small.llm_engine
    for i, prompt in enumerate(_others(5, seed=3)):
        engine.add_request(f"other-{i}", None, _greedy(40), prompt_token_ids=prompt)
    engine.add_request("target", None, _greedy(40), prompt_token_ids=PROMPT)
    target_seq = engine.engine_core.requests.states["target"].seqs[0]
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "target" and out.finished:
                final = out
    assert engine.engine_core.scheduler.num_preemptions > 0
    assert target_seq.num_preemptions > 0, "the newest request should have been preempted"
    tokens, lps = _tokens_and_logprobs(final)
    ref_tokens, ref_lps = _tokens_and_logprobs(reference)
    assert tokens == ref_tokens
    assert np.max(np.abs(lps - ref_lps)) <= 1e-4
    assert engine.engine_core.block_manager.num_free_blocks == engine.engine_core.block_manager.num_blocks


def test_serving_a_varied_workload_compiles_nothing_after_warmup(llm):
    compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = _others(20, seed=5) + [PROMPT, PROMPT, list(range(5, 150))]
        params = [_greedy(int(m)) for m in np.random.default_rng(1).integers(1, 30, len(prompts))]
        params[0] = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=9,
                                   presence_penalty=0.5, repetition_penalty=1.2, logprobs=3)
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []


def test_prompt_longer_than_max_model_len_fails_alone_and_engine_keeps_serving(llm):
    engine = llm.llm_engine
    engine.add_request("ok", None, _greedy(5), prompt_token_ids=PROMPT)
    with pytest.raises(ValueError, match=r"length 300\).*maximum model length of 256"):
        engine.add_request("too-long", None, _greedy(5), prompt_token_ids=[5] * 300)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"]
    assert len(outs[0].outputs[0].token_ids) == 5


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.llm_engine
    engine.add_request("a", None, _greedy(50), prompt_token_ids=PROMPT)
    engine.step()
    engine.step()
    engine.abort_request("a")
    outs = engine.step()
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.engine_core.block_manager.num_free_blocks == engine.engine_core.block_manager.num_blocks


def test_generate_accepts_every_prompt_form_and_keeps_input_order(llm):
    tok = llm.get_tokenizer()
    text = "hello world"
    ids = tok.encode(text)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}],
                        _greedy(6), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert outs[0].prompt == text and outs[1].prompt is None
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    single = llm.generate(text, _greedy(6), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_n_completions_and_seeded_sampling_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate([PROMPT], params, use_tqdm=False)[0]
    b = llm.generate(_others(5) + [PROMPT], params, use_tqdm=False)[-1]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "children must not share a seed"


@pytest.fixture(scope="module")
def wide_llm(make_tiny_model):
    """A token budget above the 200-token prompt: before n > 1 prefilled once, the first
    child's step also took the start of the second's prefill (no cache hit possible)."""
    return LLM(str(make_tiny_model("llama")), max_model_len=224, max_num_seqs=4,
               max_num_batched_tokens=256, kv_cache_memory_bytes=8 << 20, **precision.EXACT)


def test_n_children_prefill_a_long_shared_prompt_once(wide_llm):
    """n=4 on a 200-token prompt: one child prefills it, the other three take its 12 full
    blocks from the prefix cache (computing only their last 8 tokens); each child samples
    exactly what a lone n=1 request with that child's seed samples."""
    llm = wide_llm
    prompt = np.random.default_rng(2024).integers(5, 500, size=200).tolist()  # nothing cached
    seed, block = 77, llm.llm_engine.engine_core.block_manager.block_size
    params = SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=10, ignore_eos=True)
    before = llm.llm_engine.snapshot()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    after = llm.llm_engine.snapshot()
    shared = (len(prompt) - 1) // block * block                   # 192 tokens
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4 * len(prompt)
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * shared
    assert after.num_prompt_tokens - before.num_prompt_tokens == len(prompt) + \
        3 * (len(prompt) - shared)
    child_seeds = [seed] + [hash((seed, i)) & 0x7FFFFFFF for i in (1, 2, 3)]
    for child, child_seed in zip(out.outputs, child_seeds):
        alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=child_seed,
                                                      max_tokens=10, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert child.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_finish_reasons_max_tokens_and_stop_token(llm):
    out = llm.generate([PROMPT], _greedy(7), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    stop_at = out.token_ids[3]
    stopped = llm.generate([PROMPT], _greedy(7, stop_token_ids=[stop_at]), use_tqdm=False)
    c = stopped[0].outputs[0]
    first = out.token_ids.index(stop_at)
    assert c.finish_reason == "stop" and c.stop_reason == stop_at
    assert c.token_ids == out.token_ids[:first + 1]


def test_logprob_ranks_of_sampled_tokens_are_consistent_with_the_top_candidates(llm):
    params = SamplingParams(temperature=3.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 16
    for token, entry in zip(out.token_ids, out.logprobs):
        top1 = min(entry.values(), key=lambda lp: lp.rank if lp.rank else 1 << 30)
        sampled = entry[token]
        higher = sum(1 for lp in entry.values() if lp.logprob > sampled.logprob)
        assert sampled.rank >= 1 + higher
        assert (sampled.rank == 1) == (sampled.logprob >= top1.logprob)


def _drive(engine, request_id, prompt, params) -> list:
    engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_output_kinds_cumulative_delta_and_final_only_carry_the_same_completion(llm):
    from jaxserve import RequestOutputKind

    engine = llm.llm_engine
    runs = {}
    for kind in RequestOutputKind:
        params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, n=2, logprobs=2,
                                stop=["ab"], output_kind=kind)
        runs[kind] = _drive(engine, f"kind-{kind.name}", PROMPT, params)
    cumulative, delta, final = (runs[k] for k in RequestOutputKind)
    assert len(final) == 1 and final[0].finished
    assert len(delta) == len(cumulative) > 2 and delta[-1].finished
    for index in range(2):
        last = cumulative[-1].outputs[index]
        assert final[0].outputs[index].text == last.text
        assert final[0].outputs[index].token_ids == last.token_ids
        pieces = [c for out in delta for c in out.outputs if c.index == index]
        assert "".join(c.text for c in pieces) == last.text
        assert [t for c in pieces for t in c.token_ids] == last.token_ids
        # (runs differ by prefix-cache hits, so values agree to float tolerance)
        entries = [lp for c in pieces for lp in c.logprobs]
        assert [list(e) for e in entries] == [list(e) for e in last.logprobs]
        assert all(abs(e[t].logprob - f[t].logprob) < 1e-4
                   for e, f in zip(entries, last.logprobs) for t in e)
        assert abs(pieces[-1].cumulative_logprob - last.cumulative_logprob) < 1e-3
        # every cumulative output extends the previous one
        texts = [c.text for out in cumulative for c in out.outputs if c.index == index]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def _mixed_workload(engine) -> dict:
    """Greedy and seeded requests, n > 1, stop strings, repeated prompts (prefix hits), two
    aborts, on a cache small enough to preempt; returns the finished outputs and compiles."""
    tok = engine.tokenizer
    prompts = _others(10, seed=11) + [PROMPT, PROMPT + [7, 8], PROMPT]
    requests = {}
    for i, prompt in enumerate(prompts):
        if i % 3 == 0:
            params = _greedy(30)
        elif i % 3 == 1:
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=30,
                                    n=2, logprobs=1, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.7, seed=200 + i, max_tokens=30,
                                    ignore_eos=True, stop=[tok.decode([prompt[0]]), "ab"],
                                    repetition_penalty=1.1)
        requests[f"r{i}"] = (prompt, params)
    requests["victim-early"] = (_others(1, seed=99)[0], _greedy(30))
    requests["victim-late"] = (PROMPT[:9], _greedy(30))
    compiles: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    finished, steps = {}, 0
    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                elif out.request_id == "victim-late" and len(out.outputs[0].token_ids) >= 3:
                    engine.abort_request("victim-late")
            steps += 1
            if steps == 2:
                engine.abort_request("victim-early")
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return {"finished": finished, "compiles": compiles,
            "preemptions": engine.engine_core.scheduler.num_preemptions,
            "free": (engine.engine_core.block_manager.num_free_blocks,
                     engine.engine_core.block_manager.num_blocks)}


def test_async_and_sync_scheduling_give_identical_tokens_on_a_mixed_workload(make_tiny_model):
    runs = {}
    for mode in (True, False):
        llm = LLM(str(make_tiny_model("llama")), max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=64, num_gpu_blocks_override=14, async_scheduling=mode,
                  **precision.EXACT)
        assert llm.llm_engine.engine_core.max_steps_in_flight == (2 if mode else 1)
        runs[mode] = _mixed_workload(llm.llm_engine)
    on, off = runs[True], runs[False]
    for run in (on, off):
        assert run["compiles"] == []
        assert run["preemptions"] > 0
        assert run["free"][0] == run["free"][1]          # every block came back
        assert run["finished"]["victim-early"].outputs[0].finish_reason == "abort"
        assert run["finished"]["victim-late"].outputs[0].finish_reason == "abort"
    assert sorted(on["finished"]) == sorted(off["finished"])
    stopped = 0
    for request_id, out in on["finished"].items():
        if request_id.startswith("victim"):
            continue
        other = off["finished"][request_id]
        for a, b in zip(out.outputs, other.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                (b.token_ids, b.text, b.finish_reason, b.stop_reason), request_id
            stopped += a.stop_reason is not None
    assert stopped > 0, "the workload should end some requests on a stop string"


def test_stats_line_averages_over_busy_time_not_idle_time(caplog):
    """Two overlapping steps (async) then a long idle gap: throughput divides by the union of
    the steps' [dispatch, collect] intervals, not by the wall time of the log window."""
    import logging

    from jaxserve.engine.stats import EngineStats

    stats = EngineStats(log_interval=0.0)
    stats.record_step(num_prompt_tokens=0, num_generation_tokens=10, num_preempted=0,
                      dispatch_time=100.0, collect_time=100.5)
    stats.record_step(num_prompt_tokens=0, num_generation_tokens=10, num_preempted=0,
                      dispatch_time=100.25, collect_time=101.0)   # overlaps the first
    assert stats.busy_time_total == pytest.approx(1.0)
    assert stats.step_time_total == pytest.approx(1.25)

    class Snapshot:
        num_running = num_waiting = num_preemptions = 0
        kv_cache_usage = 0.0
        prefix_cache_queries = prefix_cache_hits = 0

    with caplog.at_level(logging.INFO, logger="jaxserve.stats"):
        stats.maybe_log(Snapshot())
    [line] = [r.getMessage() for r in caplog.records if r.name == "jaxserve.stats"]
    assert "Avg generation throughput: 20.0 tokens/s" in line, line


def _penalized_reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with vLLM's penalties, from a plain full forward per token:
    repetition by HF's RepetitionPenaltyLogitsProcessor over prompt + output, then
    frequency and presence over the output tokens' counts (numpy)."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    tokens = list(prompt)
    for _ in range(params.max_tokens):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float()
        logits = repetition(ids, logits)[0].numpy().astype(np.float32)
        counts = np.bincount(tokens[len(prompt):], minlength=logits.shape[0])
        logits = logits - np.float32(params.frequency_penalty) * counts.astype(np.float32)
        logits = logits - np.float32(params.presence_penalty) * (counts > 0)
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


def test_penalized_greedy_tokens_match_references_across_row_reuse_and_preemption(
        make_tiny_model):
    """The device-resident penalty history: rows are reused by requests with and without
    penalties (3 rows, 6 requests) and a small cache preempts and recomputes some, yet
    every request's tokens equal a from-scratch reference."""
    import torch
    import transformers

    path = make_tiny_model("llama")
    penalized = [dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
                 dict(repetition_penalty=0.8, frequency_penalty=-0.2),
                 dict(presence_penalty=1.5), {},
                 dict(repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=-0.5),
                 dict(frequency_penalty=2.0)]
    prompts = _others(len(penalized), seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, **p)
              for p in penalized]
    small = LLM(str(path), max_model_len=128, max_num_seqs=3, max_num_batched_tokens=64,
                num_gpu_blocks_override=10, **precision.EXACT)     # against a float32 torch loop
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # tiny forwards: threads cost more than they give
    try:
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            assert out.outputs[0].token_ids == _penalized_reference(model, prompt, p), p
    finally:
        torch.set_num_threads(threads)


def test_the_engine_learns_what_its_steps_cost(llm):
    """Every bucket the engine ran is measured (after its first step), for the scheduler's
    time-bounded prefill cap (jaxserve/engine/step_costs.py)."""
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    measured = engine.engine_core.step_costs.snapshot()
    assert 4 in measured, measured                 # four streams decoding: bucket 4
    assert all(seconds > 0 for seconds in measured.values())
    assert engine.engine_core.scheduler.step_costs is engine.engine_core.step_costs

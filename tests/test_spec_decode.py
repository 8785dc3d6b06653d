"""Speculative decoding (n-gram proposer): exact outputs, exact distributions, no compiles.

One tiny random Llama, served twice (speculation off and on) for the whole module. A tiny
random model's greedy text falls into loops, which the n-gram proposer predicts well, so
most steps verify drafts; the workloads mix in what must still come out identical: stop
strings, max_tokens inside a draft, EOS inside accepted drafts, preemption, prefix hits.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.platforms import CpuPlatform
from jaxserve.runner.rejection_sampler import num_emitted_tokens
from jaxserve.spec_decode.ngram import NgramProposer
from tests import precision

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
# Six step buckets (1..32 tokens): every engine compiles each at start, most of the
# module's time; 32 still fits a draft-model decode of 8 rows x (1 + 3 drafts).
COMMON = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=32,
              num_gpu_blocks_override=24, block_size=16, **precision.EXACT)


@pytest.fixture(scope="module")
def engines(make_tiny_model):
    path = str(make_tiny_model("llama"))
    off = LLM(path, **COMMON)
    on = LLM(path, speculative_config={**SPEC, "disable_by_batch_size": 8}, **COMMON)
    return off, on


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        phrase = rng.integers(5, 500, size=int(rng.integers(3, 7))).tolist()
        prompts.append((phrase * 4)[:int(rng.integers(8, 30))])    # repeats: n-gram hits
    return prompts


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    engine = llm.llm_engine
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    bm = engine.engine_core.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "every block came back"
    bm.check_invariants()
    return finished


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, **kw)


# -- units -------------------------------------------------------------------------------------
def test_ngram_proposer_takes_the_longest_latest_match_and_respects_limits():
    proposer = NgramProposer(3, prompt_lookup_min=2, prompt_lookup_max=3)
    histories = [[1, 2, 3, 9, 9, 1, 2, 3, 4, 7, 1, 2, 3],   # 3-gram [1,2,3]: latest at 5
                 [5, 6, 8, 5, 6],                           # 2-gram [5,6] at 0 → 8, 5, 6
                 [1, 2, 3, 4],                              # no repeat
                 [4, 4, 4, 4, 4]]
    assert proposer.propose(histories, [3, 3, 3, 1]) == [[4, 7, 1], [8, 5, 6], [], [4]]
    rng = np.random.default_rng(0)
    for _ in range(50):       # against a plain-Python reference on random histories
        hist = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        got = proposer.propose([hist], [3])[0]
        want = []
        for n in (3, 2):
            if len(hist) <= n:
                continue
            suffix = hist[-n:]
            starts = [s for s in range(len(hist) - n) if hist[s:s + n] == suffix]
            if starts:
                want = hist[starts[-1] + n:starts[-1] + n + 3]
                break
        assert got == want, hist


def test_acceptance_rule_keeps_the_longest_matching_prefix():
    target = jnp.array([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [3, 3, 3, 3]])
    drafts = jnp.array([[5, 6, 7], [5, 6, 7], [9, 2, 3], [3, 3, 3]])
    counts = num_emitted_tokens(target, drafts, jnp.array([3, 3, 3, 1]))
    assert counts.tolist() == [4, 2, 1, 2]     # all + bonus; one; none; limited by count


def test_point_mass_acceptance_preserves_the_target_distribution_exactly():
    """Synthetic p over 5 tokens at 2 positions, a fixed draft: accept iff the target's
    sample equals the draft. The first emitted token must follow p0 (whatever the draft),
    and after an accepted draft the second must follow p1 — chi-square on 40k draws."""
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(5), size=2)
    n = 40_000
    draws = np.stack([rng.choice(5, size=n, p=p[j]) for j in range(2)], 1)
    for draft in (int(np.argmax(p[0])), int(np.argmin(p[0]))):     # good and bad drafts
        counts = np.asarray(num_emitted_tokens(jnp.asarray(draws), jnp.full((n, 1), draft),
                                               jnp.ones(n, jnp.int32)))
        first = draws[:, 0]                 # emitted token 0: the draft if accepted, else t0
        assert np.mean(counts == 2) == pytest.approx(p[0][draft], abs=0.01)
        assert stats.chisquare(np.bincount(first, minlength=5), n * p[0]).pvalue > 1e-3
        second = draws[counts == 2, 1]
        assert stats.chisquare(np.bincount(second, minlength=5),
                               len(second) * p[1]).pvalue > 1e-3


def test_speculative_config_is_validated_with_clear_errors():
    for bad, match in [({"method": "eagle", "num_speculative_tokens": 2}, "method must be"),
                       ({**SPEC, "prompt_lookup": 3}, "unknown key"),
                       ({**SPEC, "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({**SPEC, "prompt_lookup_min": 5}, "prompt_lookup_min"),
                       ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=match):
            CpuPlatform().resolve_config(EngineConfig.from_kwargs(speculative_config=bad))
    config = CpuPlatform().resolve_config(EngineConfig.from_kwargs(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'))
    assert config.spec_decode.num_speculative_tokens == 3


def test_cli_and_yaml_take_the_dict_as_json_and_as_a_mapping(tmp_path):
    import json

    from jaxserve.entrypoints.cli import parse_serve_args
    args = parse_serve_args(["--speculative-config", json.dumps(SPEC)])
    assert args.engine.spec_decode.prompt_lookup_max == 4
    (tmp_path / "c.yaml").write_text("speculative-config:\n  method: ngram\n"
                                     "  num_speculative_tokens: 2\n")
    args = parse_serve_args(["--config", str(tmp_path / "c.yaml")])
    assert args.engine.spec_decode.num_speculative_tokens == 2


# -- end to end ------------------------------------------------------------------------------
def test_greedy_outputs_and_logprobs_are_identical_with_speculation(engines):
    off, on = engines
    tok = off.llm_engine.tokenizer
    prompts = _prompts(10, seed=3)
    # Stops taken from the text the model will write (its loops are what gets drafted).
    plain = off.generate(prompts, _greedy(30, ignore_eos=True), use_tqdm=False)
    requests = {}
    for i, (prompt, out) in enumerate(zip(prompts, plain)):
        kw, written = {}, out.outputs[0].token_ids
        if i % 4 == 1:
            kw["stop"] = [tok.decode(written[9:10])]          # a stop string
        if i % 4 == 2:
            kw["stop_token_ids"] = [written[8]]               # an "EOS" inside a draft
        requests[f"r{i}"] = (prompt, _greedy(int(7 + 11 * (i % 3)), **kw))
    requests["again"] = (prompts[0], _greedy(30))                # a prefix hit
    # Long greedy runs on a 24-block cache: preemption with drafts in flight.
    for i, prompt in enumerate(_prompts(4, seed=9)):
        requests[f"long{i}"] = (prompt * 3, _greedy(90, ignore_eos=True))
    runs = {}
    for name, llm in (("off", off), ("on", on)):
        before = llm.llm_engine.engine_core.scheduler.num_preemptions
        runs[name] = _run(llm, requests)
        runs[name + "_preempted"] = llm.llm_engine.engine_core.scheduler.num_preemptions - before
    snap = on.llm_engine.snapshot()
    assert snap.spec_decode_num_drafts > 20
    assert 0 < snap.spec_decode_num_accepted_tokens < snap.spec_decode_num_draft_tokens
    assert runs["on_preempted"] > 0
    stopped = 0
    for request_id in requests:
        a, b = runs["off"][request_id].outputs[0], runs["on"][request_id].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason), request_id
        lp_a = [e[t].logprob for t, e in zip(a.token_ids, a.logprobs)]
        lp_b = [e[t].logprob for t, e in zip(b.token_ids, b.logprobs)]
        assert np.max(np.abs(np.subtract(lp_a, lp_b)), initial=0) <= 1e-4, request_id
        assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]
        stopped += a.stop_reason is not None
    assert stopped >= 3


def test_seeded_sampling_reproduces_and_matches_no_speculation(engines):
    off, on = engines
    # Prompts that end inside the model's own greedy loops: drafts get accepted.
    prompts = [p + o.outputs[0].token_ids for p, o in zip(_prompts(6, seed=5), off.generate(
        _prompts(6, seed=5), _greedy(40, ignore_eos=True), use_tqdm=False))]
    # Low temperatures keep the tiny model in its loops (drafts get accepted); the others
    # carry every penalty, so drafts count as output tokens at later positions.
    params = [SamplingParams(temperature=0.1 if i % 2 else 0.2, top_p=0.9, top_k=100 * (i % 3),
                             seed=i, max_tokens=40, logprobs=1, ignore_eos=True,
                             **({} if i % 2 else dict(presence_penalty=0.1,
                                                      frequency_penalty=0.05,
                                                      repetition_penalty=1.05)))
              for i in range(6)]
    before = on.llm_engine.snapshot()

    def run(llm):
        # Same schedule each time: a prefix hit would chunk the prompts differently, and
        # XLA's CPU results differ in the last bits between chunkings (enough to move a
        # token across the top-p edge now and then).
        assert llm.llm_engine.engine_core.block_manager.reset_prefix_cache()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    a, b, c = run(on), run(on), run(off)
    after = on.llm_engine.snapshot()
    assert after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens > 10
    assert a == b
    # Each output index is sampled with the same uniforms with or without drafts.
    assert a == c


def _sample(llm: LLM, prompt: list[int], params: SamplingParams, n: int,
            first_seed: int) -> np.ndarray:
    """n completions of one prompt, all in one generate call: [n, max_tokens]. Request i
    has seed first_seed + i: unseeded requests draw their seeds from each engine's own
    seeded stream, so two fresh engines would sample with the same uniforms (on and off
    then agree token for token, and a chi-square test of them would test nothing)."""
    batch = []
    for i in range(n):
        one = params.clone()
        one.seed = first_seed + i
        batch.append(one)
    outs = llm.generate([prompt] * n, batch, use_tqdm=False)
    return np.array([o.outputs[0].token_ids for o in outs])


def _pvalues(a: np.ndarray, b: np.ndarray) -> list[float]:
    """Per output position, the chi-square test of independence of two sample sets [n, T]
    (cells with < 5 draws pooled away; 1.0 where fewer than two cells remain)."""
    pvalues = []
    for pos in range(a.shape[1]):
        values = np.union1d(a[:, pos], b[:, pos])
        table = np.array([[np.sum(x[:, pos] == v) for v in values] for x in (a, b)])
        table = table[:, table.sum(0) >= 5]
        pvalues.append(stats.chi2_contingency(table).pvalue if table.shape[1] > 1 else 1.0)
    return pvalues


def _draft_counters(llm: LLM, run) -> tuple[Any, tuple[int, int]]:
    """run()'s result, and the (draft tokens, accepted tokens) it added to llm's counters."""
    before = llm.llm_engine.snapshot()
    result = run()
    after = llm.llm_engine.snapshot()
    return result, (after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                    after.spec_decode_num_accepted_tokens
                    - before.spec_decode_num_accepted_tokens)


def _chi_square_on_vs_off(engines, prompt, params, n):
    """Sample n completions with and without speculation; chi-square test of independence
    per output position. Returns the draft counters."""
    off, on = engines
    samples, counters = _draft_counters(on, lambda: _sample(on, prompt, params, n, n))
    pvalues = _pvalues(_sample(off, prompt, params, n, 0), samples)
    assert min(pvalues) > 1e-3, pvalues
    return counters


def test_sampled_tokens_follow_the_same_distribution_with_bad_and_good_drafts(engines):
    """Temperature 1 with top-p, unseeded; logit bias confines the random model to a few
    tokens, so the proposer finds n-grams in the history. Bad drafts: twelve tokens (the
    history rarely predicts the next); good ones: three; perfect: one token (p is a point
    mass: acceptance ~100%, the draft-equals-target case)."""
    dozen = list(range(40, 52))
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, ignore_eos=True,
                            logit_bias={t: 30.0 + 0.1 * (t % 5) for t in dozen})
    drafted, accepted = _chi_square_on_vs_off(engines, dozen * 2, params, 200)
    assert drafted > 50 and accepted < 0.2 * drafted
    trio = {40: 30.0, 41: 30.5, 42: 29.5}
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=6, ignore_eos=True,
                            logit_bias=trio)
    drafted, accepted = _chi_square_on_vs_off(engines, [40, 41, 42] * 6, params, 200)
    # p(draft) ~ 1/3 a position; with 4 drafts a round the accepted fraction of drafted
    # tokens is about (a + a^2 + a^3 + a^4) / 4 ~ 0.12 (0.17 with these seeds)
    assert drafted > 200 and 0.08 * drafted < accepted < 0.9 * drafted
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True,
                            logit_bias={41: 60.0})
    drafted, accepted = _chi_square_on_vs_off(engines, [40, 41] * 6, params, 20)
    assert drafted > 40 and accepted >= 0.99 * drafted


def test_speculation_compiles_nothing_after_warmup(engines):
    _, on = engines
    compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = _prompts(12, seed=7) + [list(range(5, 90))]
        rng = np.random.default_rng(2)
        params = [SamplingParams(temperature=float(rng.choice([0.0, 0.7])), seed=i,
                                 max_tokens=int(rng.integers(1, 40)), logprobs=1,
                                 frequency_penalty=0.2 * (i % 2)) for i in range(13)]
        on.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []


def test_prometheus_exports_vllm_spec_decode_counters():
    from jaxserve.engine.snapshot import EngineSnapshot, combine_snapshots
    from jaxserve.metrics import ServerMetrics

    snap = EngineSnapshot(spec_decode_num_drafts=7, spec_decode_num_draft_tokens=20,
                          spec_decode_num_accepted_tokens=9,
                          spec_decode_accepted_per_pos=(5, 3, 1, 0))
    text = ServerMetrics("m", lambda: snap).render().decode()
    assert 'jaxserve:spec_decode_num_drafts_total{model_name="m"} 7.0' in text
    assert 'jaxserve:spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_total{model_name="m"} 9.0' in text
    assert ('jaxserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="1"} 3.0') in text
    # Replicas' snapshots sum position by position (data parallelism sums every field).
    assert combine_snapshots([snap] * 2).spec_decode_accepted_per_pos == (10, 6, 2, 0)
    assert "spec_decode" not in ServerMetrics("m", EngineSnapshot).render().decode()


# -- draft model ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_engine(make_tiny_model):
    """Target: the tiny Llama; draft: the same tiny Llama (the upper bound: its greedy
    drafts are the target's greedy tokens, so greedy rows accept ~all of them; a one-layer
    random draft agreed with it on nothing, which exercises only rejection)."""
    draft = str(make_tiny_model("llama"))
    return LLM(str(make_tiny_model("llama")), speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3,
        "disable_by_batch_size": 8}, **COMMON)


def test_draft_model_greedy_and_seeded_outputs_equal_no_speculation(engines, draft_engine):
    off, _ = engines
    prompts = _prompts(8, seed=13) + [list(range(5, 70))]
    params = [_greedy(int(5 + 9 * (i % 4)), ignore_eos=i % 2 == 0) for i in range(9)]
    params[3] = SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=30, logprobs=2)
    for llm in (off, draft_engine):
        assert llm.llm_engine.engine_core.block_manager.reset_prefix_cache()
    before = draft_engine.llm_engine.snapshot()
    want = off.generate(prompts, params, use_tqdm=False)
    got = draft_engine.generate(prompts, params, use_tqdm=False)
    after = draft_engine.llm_engine.snapshot()
    assert after.spec_decode_num_drafts - before.spec_decode_num_drafts > 10
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert accepted >= 0.8 * drafted      # all but the sampled row's misses
    for a, b in zip(want, got):
        a, b = a.outputs[0], b.outputs[0]
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
        lp_a = [e[t].logprob for t, e in zip(a.token_ids, a.logprobs)]
        lp_b = [e[t].logprob for t, e in zip(b.token_ids, b.logprobs)]
        assert np.max(np.abs(np.subtract(lp_a, lp_b)), initial=0) <= 1e-4
    proposer = draft_engine.llm_engine.engine_core._proposer
    proposer.block_manager.check_invariants([])
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


@pytest.fixture(scope="module")
def bad_draft_engine(make_tiny_model):
    """Target: the tiny Llama; draft: another random tiny Llama of the same vocabulary (one
    layer, other weights, sharper): its argmax is rarely among the target's likely tokens."""
    return LLM(str(make_tiny_model("llama")), speculative_config={
        "method": "draft_model", "model": str(make_tiny_model(BAD_DRAFT[0], **BAD_DRAFT[1])),
        "num_speculative_tokens": 3, "disable_by_batch_size": 8}, **COMMON)


BAD_DRAFT = ("llama", {"num_hidden_layers": 1, "initializer_range": 0.5})


def test_draft_model_greedy_acceptance_is_all_for_a_perfect_draft(draft_engine):
    # Draft = target weights: its greedy drafts are the target's greedy tokens.
    params = _greedy(20, ignore_eos=True)
    _, (drafted, accepted) = _draft_counters(draft_engine, lambda: draft_engine.generate(
        _prompts(6, seed=17), params, use_tqdm=False))
    assert drafted > 30 and accepted >= 0.99 * drafted
    # One stream at a time: the draft's decodes are back-to-back (1, 1) steps.
    for prompt in _prompts(2, seed=19):
        _, (drafted, accepted) = _draft_counters(draft_engine, lambda: draft_engine.generate(
            [prompt], params, use_tqdm=False))
        assert drafted >= 3 and accepted >= 0.99 * drafted, (drafted, accepted)


def test_draft_model_sampling_follows_the_target_distribution(engines, draft_engine,
                                                              bad_draft_engine, make_tiny_model):
    """Temperature 1 with top-p, unseeded, 240 samples of one prompt with speculation off,
    with a bad draft model and with a perfect one (draft = target), chi-square per output
    position. The draft proposes its argmax (q a point mass on d): exact speculative
    sampling accepts d with min(1, p(d)/q(d)) = p(d) and on rejection samples
    max(0, p - q) normalised = p without d, renormalised; the rejection sampler's
    "accept iff the target's own sample t ~ p equals d, emit t" is that rule.

    The tiny random target is near uniform (p(top) ~ 1 %), so top_k 4 concentrates it
    enough for the test to have power (top-p 0.7 then cuts one or two of the four).
    Token 0 comes from the prefill (no drafts); tokens 1-4 from verified drafts."""
    import transformers

    from tests.hf_reference import hf_greedy

    off = engines[0]
    prompt, n = [11, 23, 98, 7, 300, 45], 240
    params = SamplingParams(temperature=1.0, top_p=0.7, top_k=4, max_tokens=5,
                            ignore_eos=True)
    want = _sample(off, prompt, params, n, 0)
    assert len(np.unique(want[:, 1])) >= 2          # a distribution, not a point mass
    drafts = {"bad": (bad_draft_engine, make_tiny_model(BAD_DRAFT[0], **BAD_DRAFT[1])),
              "perfect": (draft_engine, make_tiny_model("llama"))}
    for seed, (name, (llm, draft_dir)) in enumerate(drafts.items(), 1):
        got, (drafted, accepted) = _draft_counters(
            llm, lambda: _sample(llm, prompt, params, n, seed * n))
        pvalues = _pvalues(want, got)
        assert min(pvalues) > 1e-3, (name, pvalues)
        # Acceptance is p(draft): ~0 for the bad draft; for the perfect one the target's
        # top-token probability after top-k/top-p (~0.4 here; with 3 drafts a round, the
        # accepted fraction of drafted tokens is (a + a^2 + a^3) / 3, ~0.2).
        logging.getLogger(__name__).warning("%s draft: %d of %d drafts accepted, p-values %s",
                                            name, accepted, drafted, np.round(pvalues, 3))
        assert drafted > n, name
        if name == "bad":
            assert accepted < 0.05 * drafted
        else:
            assert 0.1 * drafted < accepted < 0.8 * drafted
        # Negative control: an always-accept rule would emit the draft model's greedy
        # tokens after token 0; the same test rejects those samples.
        draft_hf = transformers.AutoModelForCausalLM.from_pretrained(
            draft_dir, dtype="float32").eval()
        greedy = {t: hf_greedy(draft_hf, prompt + [int(t)], 3) for t in np.unique(got[:, 0])}
        always = np.array([[row[0], *greedy[row[0]], row[4]] for row in got])
        assert min(_pvalues(want, always)[1:4]) < 1e-6, name

"""The jitted sampler against numpy references of vLLM's formulas, and its host builder."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.sampler import process_logits, sample, sampling_probs
from jaxserve.runner.sampling_tensors import SamplingTensors
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_contract import NewSeqData, SchedulerOutput
from jaxserve.step_inputs import StepLayout

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

# One shape for most tests (each new shape is a compile): V is not a multiple of the
# block widths and large enough for the two-level top-k.
S, V, P, NB, K = 16, 20011, 48, 8, 5
NUM_CANDIDATES = 64

sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs", "num_candidates"))
process_jit = jax.jit(process_logits)
probs_jit = jax.jit(sampling_probs, static_argnames=("num_candidates",))


def make_tensors(rows: int = S, vocab: int = V, history: int = P, **values) -> SamplingTensors:
    """Neutral (greedy) rows, with the given fields broadcast over them."""
    base = {
        "temperature": np.zeros(rows, np.float32), "top_k": np.zeros(rows, np.int32),
        "top_p": np.ones(rows, np.float32), "min_p": np.zeros(rows, np.float32),
        "presence_penalty": np.zeros(rows, np.float32),
        "frequency_penalty": np.zeros(rows, np.float32),
        "repetition_penalty": np.ones(rows, np.float32), "seeds": np.zeros(rows, np.uint32),
        "step_index": np.zeros(rows, np.int32), "num_logprobs": np.full(rows, -1, np.int32),
        "penalty_token_ids": np.full((rows, history), -1, np.int32),
        "num_prompt_tokens": np.zeros(rows, np.int32),
        "bias_token_ids": np.full((rows, NB), -1, np.int32),
        "bias_values": np.zeros((rows, NB), np.float32),
        "newest_token_ids": np.full(rows, -1, np.int32)}
    for name, value in values.items():
        base[name] = np.broadcast_to(np.asarray(value, base[name].dtype),
                                     base[name].shape).copy()
    return SamplingTensors(**base)


def random_logits(rng: np.random.Generator, rows: int = S, vocab: int = V) -> np.ndarray:
    # LM-like: a row offset and scale, a handful of strong tokens over a long tail.
    logits = rng.standard_normal((rows, vocab)) * rng.uniform(1.0, 3.0, (rows, 1))
    logits += rng.standard_normal((rows, 1))
    strong = rng.integers(0, vocab, (rows, 8))
    np.put_along_axis(logits, strong, rng.uniform(6, 12, (rows, 8)), axis=1)
    return logits.astype(np.float32)


def rows_of(t: SamplingTensors, index: np.ndarray) -> dict:
    return {name: getattr(t, name)[index] for name in t.__dataclass_fields__}


# -- numpy references (vLLM v1) -----------------------------------------------------------
def ref_process(logits: np.ndarray, t: SamplingTensors) -> np.ndarray:
    out = logits.copy()
    for i in range(out.shape[0]):
        for token, value in zip(t.bias_token_ids[i], t.bias_values[i]):
            if token >= 0:
                out[i, token] += value
        ids = t.penalty_token_ids[i]
        prompt, output = ids[:t.num_prompt_tokens[i]], ids[t.num_prompt_tokens[i]:]
        prompt_mask = np.bincount(prompt[prompt >= 0], minlength=out.shape[1]) > 0
        counts = np.bincount(output[output >= 0], minlength=out.shape[1]).astype(np.float32)
        rep = np.where(prompt_mask | (counts > 0), t.repetition_penalty[i], np.float32(1.0))
        row = np.where(out[i] > 0, out[i] / rep, out[i] * rep).astype(np.float32)
        row -= t.frequency_penalty[i] * counts
        row -= t.presence_penalty[i] * (counts > 0).astype(np.float32)
        out[i] = row
    return out


def ref_probs(processed: np.ndarray, t: SamplingTensors) -> np.ndarray:
    """vLLM's temperature → min_p → top_k → top_p (sort based), in float64."""
    out = np.zeros(processed.shape, np.float64)
    for i in range(processed.shape[0]):
        x = (processed[i] / np.float32(t.temperature[i])).astype(np.float64)
        vocab = x.shape[0]
        if t.min_p[i] > 0:
            probs = softmax(x)
            x = np.where(probs >= t.min_p[i] * probs.max(), x, -np.inf)
        order = np.argsort(x, kind="stable")
        s = x[order]
        if 0 < t.top_k[i] < vocab:
            s = np.where(s < s[vocab - t.top_k[i]], -np.inf, s)
        if t.top_p[i] < 1:
            cum = np.cumsum(softmax(s))
            mask = cum <= 1 - np.float64(np.float32(t.top_p[i]))
            mask[-1] = False
            s = np.where(mask, -np.inf, s)
        filtered = np.empty_like(x)
        filtered[order] = s
        out[i] = softmax(filtered)
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def random_penalty_tensors(rng: np.random.Generator, **extra) -> SamplingTensors:
    history = rng.integers(0, V, (S, P)).astype(np.int32)
    history[:, ::7] = rng.integers(0, 40, (S, (P + 6) // 7))    # repeats
    lengths = rng.integers(1, P + 1, S)
    history[np.arange(P)[None, :] >= lengths[:, None]] = -1
    history[3] = -1                                              # a row without history
    return make_tensors(
        repetition_penalty=rng.uniform(0.5, 2.0, S), frequency_penalty=rng.uniform(-2, 2, S),
        presence_penalty=rng.uniform(-2, 2, S), penalty_token_ids=history,
        num_prompt_tokens=rng.integers(0, P, S), **extra)


# -- stage tests --------------------------------------------------------------------------
def test_penalties_match_vllm_formulas():
    rng = np.random.default_rng(1)
    logits = random_logits(rng)
    t = random_penalty_tensors(rng)
    got = np.asarray(process_jit(logits, t))
    np.testing.assert_allclose(got, ref_process(logits, t), rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, logits)


def test_newest_token_unknown_to_the_host_counts_as_an_output_token():
    # Async scheduling: the token fed this step is not in the host's history yet.
    rng = np.random.default_rng(11)
    logits = random_logits(rng)
    t = random_penalty_tensors(rng)
    newest = rng.integers(0, V, S).astype(np.int32)
    newest[5] = -1
    history = t.penalty_token_ids.copy()
    lengths = (history >= 0).sum(1)
    appended = np.full((S, P + 1), -1, np.int32)
    appended[:, :P] = history
    appended[np.arange(S), lengths] = newest
    want = ref_process(logits, make_tensors(history=P + 1, **{
        **rows_of(t, slice(None)), "penalty_token_ids": appended,
        "num_prompt_tokens": np.minimum(t.num_prompt_tokens, lengths)}))
    got = np.asarray(process_jit(logits, make_tensors(**{**rows_of(t, slice(None)),
                                                         "newest_token_ids": newest})))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_logit_bias_and_bans_are_added_before_penalties():
    rng = np.random.default_rng(2)
    logits = random_logits(rng)
    bias_ids = np.full((S, NB), -1, np.int32)
    bias_ids[:, :3] = rng.integers(0, V, (S, 3))
    bias_ids[:, 3] = logits.argmax(-1)                  # ban each row's favourite
    bias_values = np.zeros((S, NB), np.float32)
    bias_values[:, :3] = rng.uniform(-100, 100, (S, 3))
    bias_values[:, 3] = -np.inf
    t = random_penalty_tensors(rng, bias_token_ids=bias_ids, bias_values=bias_values)
    got = np.asarray(process_jit(logits, t))
    np.testing.assert_allclose(got, ref_process(logits, t), rtol=1e-6, atol=1e-6)
    assert np.all(got[np.arange(S), logits.argmax(-1)] == -np.inf)


def test_greedy_rows_take_argmax_of_processed_logits():
    rng = np.random.default_rng(3)
    logits = random_logits(rng)
    boosted = rng.integers(0, V, S)
    bias_ids = np.full((S, NB), -1, np.int32)
    bias_ids[::2, 0] = boosted[::2]
    t = random_penalty_tensors(rng, bias_token_ids=bias_ids, bias_values=50.0,
                               temperature=np.where(np.arange(S) % 3 == 0, 1.0, 0.0),
                               top_p=0.9, seeds=np.arange(S))
    out = sample_jit(logits, t, num_top_logprobs=K)
    greedy = np.asarray(t.temperature) == 0
    expected = ref_process(logits, t).argmax(-1)
    np.testing.assert_array_equal(np.asarray(out.next_tokens)[greedy], expected[greedy])
    # An all-greedy batch (the cheap path) agrees too.
    t_greedy = make_tensors(**{**rows_of(t, slice(None)), "temperature": 0.0})
    out = sample_jit(logits, t_greedy, num_top_logprobs=K)
    np.testing.assert_array_equal(np.asarray(out.next_tokens),
                                  ref_process(logits, t_greedy).argmax(-1))


FILTER_CASES = {
    "temperature": {"temperature": 0.7},
    "min_p": {"temperature": 1.3, "min_p": 0.05},
    "top_k_small": {"temperature": 0.9, "top_k": 7},
    "top_k_above_candidates": {"temperature": 1.0, "top_k": 300},
    "top_p_small_nucleus": {"temperature": 0.5, "top_p": 0.8},
    "top_p_large_nucleus": {"temperature": 1.5, "top_p": 0.95},
    "top_k_top_p_min_p": {"temperature": 1.1, "top_k": 40, "top_p": 0.7, "min_p": 0.01},
    "top_k_large_top_p": {"temperature": 2.0, "top_k": 5000, "top_p": 0.9},
}


@pytest.mark.parametrize("case", list(FILTER_CASES))
def test_filtered_distribution_matches_numpy(case):
    rng = np.random.default_rng(sorted(FILTER_CASES).index(case))
    logits = random_logits(rng)
    t = make_tensors(seeds=np.arange(S), step_index=3, **FILTER_CASES[case])
    got = np.asarray(probs_jit(logits, t, num_candidates=NUM_CANDIDATES))
    want = ref_probs(logits, t)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)
    tokens = np.asarray(sample_jit(logits, t, num_top_logprobs=K).next_tokens)
    assert np.all(want[np.arange(S), tokens] > 0), "sampled a filtered-out token"


def test_keep_bounds_at_exactly_zero():
    """A row max or k-th value of exactly 0.0 is kept: the sampler keeps x > (the float
    below the bound), and XLA:CPU compares denormals as 0."""
    logits = np.full((S, V), -3.0, np.float32)
    logits[:, 5:50] = -1.0
    logits[:, 1234] = 0.0
    greedy = np.arange(S) % 2 == 0        # mixed with random rows: the sampling loop
    t = make_tensors(temperature=np.where(greedy, 0.0, 1.0), top_k=np.where(greedy, 0, 1),
                     seeds=np.arange(S))
    tokens = np.asarray(sample_jit(logits, t, num_top_logprobs=K).next_tokens)
    np.testing.assert_array_equal(tokens, 1234)
    probs = np.asarray(probs_jit(logits, t, num_candidates=NUM_CANDIDATES))
    np.testing.assert_array_equal(probs[~greedy, 1234], 1.0)


def mixed_batch(rng: np.random.Generator) -> tuple[np.ndarray, SamplingTensors]:
    """Rows with every feature: greedy, filters, penalties, bias, logprobs."""
    logits = random_logits(rng)
    t = random_penalty_tensors(
        rng, temperature=rng.choice([0.0, 0.6, 1.0, 1.7], S),
        top_k=rng.choice([0, 5, 50, 500], S), top_p=rng.choice([1.0, 0.9, 0.97], S),
        min_p=rng.choice([0.0, 0.02], S), seeds=rng.integers(0, 2**32, S),
        step_index=rng.integers(0, 100, S), num_logprobs=rng.choice([-1, 0, 3], S),
        bias_token_ids=np.where(rng.random((S, NB)) < 0.3, rng.integers(0, V, (S, NB)), -1),
        bias_values=rng.uniform(-5, 5, (S, NB)))
    return logits, t


def test_seeded_sample_does_not_depend_on_position_or_neighbours():
    rng = np.random.default_rng(4)
    logits_a, t_a = mixed_batch(rng)
    logits_b, t_b = mixed_batch(rng)
    out_a = sample_jit(logits_a, t_a, num_top_logprobs=K)
    for row in range(S):
        # Row `row` of batch A moved to another position among batch B's rows...
        position = (row * 7 + 3) % S
        logits = logits_b.copy()
        logits[position] = logits_a[row]
        fields = rows_of(t_b, slice(None))
        for name, values in rows_of(t_a, row).items():
            fields[name][position] = values
        out_b = sample_jit(logits, make_tensors(**fields), num_top_logprobs=K)
        # ... and alone among padding rows.
        alone = {name: value[None] for name, value in rows_of(t_a, row).items()}
        padded = make_tensors(**{name: np.concatenate([v, getattr(make_tensors(), name)[1:]])
                                 for name, v in alone.items()})
        out_alone = sample_jit(np.concatenate([logits_a[row:row + 1], logits_b[1:]]), padded,
                               num_top_logprobs=K)
        for other, at in ((out_b, position), (out_alone, 0)):
            assert int(other.next_tokens[at]) == int(out_a.next_tokens[row]), (row, at)
            if t_a.num_logprobs[row] >= 0:
                assert float(other.sampled_logprobs[at]) == float(out_a.sampled_logprobs[row])


def test_different_steps_and_seeds_give_different_samples():
    logits = np.zeros((S, V), np.float32) + np.random.default_rng(5).normal(0, 0.1, (S, V))
    same = make_tensors(temperature=1.0, seeds=7, step_index=11, top_p=0.999)
    tokens = np.asarray(sample_jit(logits[:1].repeat(S, 0), same, num_top_logprobs=K)
                        .next_tokens)
    assert len(set(tokens.tolist())) == 1             # same seed, step and logits
    steps = make_tensors(temperature=1.0, seeds=7, step_index=np.arange(S))
    tokens = np.asarray(sample_jit(logits[:1].repeat(S, 0), steps, num_top_logprobs=K)
                        .next_tokens)
    assert len(set(tokens.tolist())) > S // 2


def test_logprobs_are_log_softmax_of_raw_logits():
    rng = np.random.default_rng(6)
    logits, t = mixed_batch(rng)
    t = make_tensors(**{**rows_of(t, slice(None)), "num_logprobs": 2})
    out = sample_jit(logits, t, num_top_logprobs=K)
    raw = log_softmax(logits)
    tokens = np.asarray(out.next_tokens)
    chosen = raw[np.arange(S), tokens]
    np.testing.assert_allclose(np.asarray(out.sampled_logprobs), chosen, rtol=1e-5, atol=1e-5)
    ranks = (raw >= chosen[:, None]).sum(-1)
    np.testing.assert_array_equal(np.asarray(out.sampled_ranks), ranks)
    top_ids, top_lp = np.asarray(out.top_token_ids), np.asarray(out.top_logprobs)
    np.testing.assert_array_equal(top_ids, np.argsort(-logits, -1, kind="stable")[:, :K])
    np.testing.assert_allclose(top_lp, np.sort(raw, -1)[:, ::-1][:, :K], rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(top_lp, axis=-1) <= 0)


def test_no_logprobs_requested_skips_them():
    rng = np.random.default_rng(7)
    out = sample_jit(random_logits(rng), make_tensors(), num_top_logprobs=K)
    assert not np.any(np.asarray(out.top_logprobs)) and not np.any(out.sampled_logprobs)


# -- the sampled distribution is exact ----------------------------------------------------
DIST_VOCAB, DIST_ROWS = 600, 9000


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic over the tokens with expected count >= 5 (plus the rest)."""
    counts = np.bincount(tokens, minlength=probs.shape[0])
    expected = probs * len(tokens)
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expect = np.append(expected[big], expected[~big].sum())
    keep = expect > 0
    assert counts[probs == 0].sum() == 0, "sampled a token with zero probability"
    return float(((observed[keep] - expect[keep]) ** 2 / expect[keep]).sum()), int(keep.sum())


def test_inverse_cdf_samples_follow_the_filtered_distribution():
    """Many seeds on one row of logits, one group of rows per filter setting.

    With 4 candidates the groups cover every path: no filter, min_p, top_k within the
    candidates, top_p (rejection sampling) with a small and a large nucleus, and top_k
    beyond the candidates (bisection) with top_p.
    """
    rng = np.random.default_rng(8)
    row = np.full(DIST_VOCAB, -np.inf, np.float32)
    support = rng.choice(DIST_VOCAB, 14, replace=False)          # spread over the blocks
    row[support] = rng.normal(0, 1.2, 14)
    row[rng.choice(DIST_VOCAB, 200)] = -8.0 + rng.normal(0, 0.5, 200)   # a thin tail
    params = [{"temperature": 1.0}, {"temperature": 1.0, "min_p": 0.1},
              {"temperature": 1.0, "top_k": 3}, {"temperature": 0.7, "top_p": 0.4},
              {"temperature": 0.8, "top_p": 0.85}, {"temperature": 1.2, "top_k": 6, "top_p": 0.9}]
    n = DIST_ROWS // len(params)
    fields = {"seeds": np.arange(DIST_ROWS) % 997, "step_index": np.arange(DIST_ROWS) // 997}
    for name in ("temperature", "top_k", "top_p", "min_p"):
        default = getattr(make_tensors(rows=1), name)[0]
        fields[name] = np.repeat([p.get(name, default) for p in params], n)
    t = make_tensors(rows=DIST_ROWS, vocab=DIST_VOCAB, **fields)
    logits = np.broadcast_to(row, (DIST_ROWS, DIST_VOCAB))
    out = sample_jit(logits, t, num_top_logprobs=0, num_candidates=4)
    assert out.top_token_ids.shape == (DIST_ROWS, 0)
    tokens = np.asarray(out.next_tokens)
    want = ref_probs(logits[::n], make_tensors(rows=len(params), vocab=DIST_VOCAB,
                                               **{k: v[::n] for k, v in fields.items()}))
    for i in range(len(params)):
        stat, cells = chi_square(tokens[i * n:(i + 1) * n], want[i])
        # df <= 15: chi2 quantile at 1 - 1e-7 is < 60; deterministic seeds, so no flakes.
        assert stat < 60, (params[i], stat, cells)


# -- host side: the runner's persistent batch ----------------------------------------------
_SEQ_IDS = iter(range(1000, 100000))


def new_seq(prompt: list[int], seed: int = 0, **params) -> NewSeqData:
    return NewSeqData(next(_SEQ_IDS), list(prompt), len(prompt), [0], 0,
                      SamplingParams(**params), seed)


def prepare(batch: InputBatch, seqs: list[NewSeqData], padded: int, computed=None,
            new: list[NewSeqData] = ()):
    """One step that decodes every seq in ``seqs`` (admitting ``new`` first)."""
    computed = computed or [len(s.token_ids) - 1 for s in seqs]
    out = SchedulerOutput(seq_ids=[s.seq_id for s in seqs], num_scheduled_tokens=[1] * len(seqs),
                          num_computed_tokens=computed, is_sampling=[True] * len(seqs),
                          new_seqs=list(new), total_num_scheduled_tokens=len(seqs))
    rows = batch.apply(out)
    inputs = batch.prepare(out, rows, padded, padded)
    return inputs, StepLayout(padded, padded, batch.width).views(inputs.packed), rows


def test_batch_rows_padding_and_sampling_fields():
    batch = InputBatch(8, 32, 16, 2, num_bias_slots=6, eos_token_ids=[2])
    a = new_seq([5, 6, 7, 4], seed=11, temperature=0.7, top_k=-1, top_p=0.9, logprobs=2)
    b = new_seq([8, 9], seed=(1 << 40) + 3, temperature=0.0)
    inputs, v, _ = prepare(batch, [a, b], 4, new=[a, b])
    np.testing.assert_allclose(v["temperature"], [0.7, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(v["top_p"], [0.9, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(v["top_k"], [0, 0, 0, 0])
    np.testing.assert_array_equal(v["num_logprobs"], [2, -1, -1, -1])
    np.testing.assert_array_equal(v["kv_lens"] - v["num_prompt_tokens"], [0, 0, 0, 0])
    assert v["seeds"].dtype == np.uint32 and v["seeds"][0] == 11 and v["seeds"][1] != 3
    np.testing.assert_array_equal(v["token_ids"][:2], [4, 9])     # the newest known tokens
    assert inputs.penalty_admissions is None and inputs.bias_token_ids is None
    # Padding rows of a smaller batch do not keep the old rows' values.
    _, v, _ = prepare(batch, [b], 4)
    np.testing.assert_allclose(v["temperature"], 0.0)
    np.testing.assert_array_equal(v["num_logprobs"], -1)


def history_of(inputs) -> dict[int, tuple[list[int], list[int]]]:
    """The admissions of a step: row -> (prompt tokens, output tokens) it loads."""
    entries = inputs.penalty_admissions.chunks.transpose(1, 0, 2).reshape(3, -1)
    loaded = {}
    for row, token, is_prompt in entries.T.tolist():
        if row >= 0:
            loaded.setdefault(row, ([], []))[0 if is_prompt else 1].append(token)
    return loaded


def test_batch_loads_a_penalty_rows_history_once_and_marks_its_samples():
    batch = InputBatch(4, 16, 16, 1, num_bias_slots=4)
    pen = new_seq([3, 4, 5], temperature=1.0, repetition_penalty=1.2)
    plain = new_seq([6, 7])
    inputs, v, rows = prepare(batch, [plain, pen], 2, new=[plain, pen])
    # Admission: the penalty row (only) is reset and its prompt loaded, once.
    resets = inputs.penalty_admissions.resets
    assert resets[0] == rows[1] and np.all(resets[1:] == -1)
    assert history_of(inputs) == {int(rows[1]): ([3, 4, 5], [])}
    np.testing.assert_array_equal(v["penalty_counted"], [0, 1])
    batch.record_sampled([plain.seq_id, pen.seq_id], rows, v["kv_lens"][:2].copy(),
                         [True, True], [9, 9])
    inputs, v, _ = prepare(batch, [pen, plain], 2, computed=[3, 2])
    assert inputs.penalty_admissions is None        # later samples are counted on the device
    np.testing.assert_array_equal(v["penalty_counted"], [1, 0])
    # A preempted sequence resumes in a fresh row: its earlier outputs load as outputs.
    batch.apply(SchedulerOutput(preempted_seq_ids=[pen.seq_id]))
    resumed = NewSeqData(pen.seq_id, [3, 4, 5, 9, 8], 3, [0], 0,
                         SamplingParams(repetition_penalty=1.2), 0)
    inputs, v, rows = prepare(batch, [resumed], 2, new=[resumed])
    assert history_of(inputs) == {int(rows[0]): ([3, 4, 5], [9, 8])}
    # A partial prefill chunk samples nothing: its junk sample is not counted.
    out = SchedulerOutput(seq_ids=[resumed.seq_id], num_scheduled_tokens=[1],
                          num_computed_tokens=[4], is_sampling=[False],
                          total_num_scheduled_tokens=1)
    inputs = batch.prepare(out, batch.apply(out), 2, 2)
    assert StepLayout(2, 2, batch.width).views(inputs.packed)["penalty_counted"][0] == 0


def test_batch_min_tokens_bans_eos_and_stop_tokens_until_reached():
    batch = InputBatch(4, 16, 16, 1, num_bias_slots=5, eos_token_ids=[2])
    seq = new_seq([3, 4], min_tokens=2, stop_token_ids=[7], logit_bias={5: 1.5})
    ignore = new_seq([3, 3], min_tokens=2, ignore_eos=True)
    inputs, _, _ = prepare(batch, [seq, ignore], 2, new=[seq, ignore])
    row = dict(zip(inputs.bias_token_ids[0].tolist(), inputs.bias_values[0].tolist()))
    assert row == {5: 1.5, 7: -np.inf, 2: -np.inf, -1: 0.0}
    assert 2 not in inputs.bias_token_ids[1]                  # EOS is no stop with ignore_eos
    inputs, _, _ = prepare(batch, [seq, ignore], 2, computed=[3, 3])    # 2 outputs so far
    row = dict(zip(inputs.bias_token_ids[0].tolist(), inputs.bias_values[0].tolist()))
    assert row == {5: 1.5, -1: 0.0}
    np.testing.assert_array_equal(inputs.bias_token_ids[1], -1)


def test_min_tokens_ban_blocks_eos_in_the_sampler():
    eos = 2
    logits = random_logits(np.random.default_rng(9))
    logits[:, eos] = 40.0                                  # EOS is the obvious choice
    temperature = np.where(np.arange(S) % 2, 0.0, 1.0)
    ban = make_tensors(temperature=temperature, seeds=np.arange(S),
                       bias_token_ids=np.where(np.arange(NB) == 0, eos, -1),
                       bias_values=np.where(np.arange(NB) == 0, -np.inf, 0.0))
    tokens = np.asarray(sample_jit(logits, ban, num_top_logprobs=K).next_tokens)
    assert np.all(tokens != eos)
    free = make_tensors(temperature=temperature, seeds=np.arange(S))
    assert np.all(np.asarray(sample_jit(logits, free, num_top_logprobs=K).next_tokens) == eos)


def test_requests_that_need_too_many_bias_slots_are_rejected():
    batch = InputBatch(2, 8, 16, 1, num_bias_slots=2, eos_token_ids=[1])
    with pytest.raises(ValueError, match="num_bias_slots=2"):
        batch.check(SamplingParams(logit_bias={3: 1.0, 4: 1.0}, min_tokens=1))
    batch.check(SamplingParams(logit_bias={3: 1.0, 4: 1.0}))


def test_row_uniforms_are_uniform_and_uncorrelated():
    from jaxserve.runner.sampler import _uniforms
    seeds, steps = np.meshgrid(np.arange(200), np.arange(200), indexing="ij")
    t = make_tensors(rows=seeds.size, vocab=2, seeds=seeds.ravel(), step_index=steps.ravel())
    u = np.asarray(jax.jit(_uniforms, static_argnums=1)(t, 3))       # [40000, 3]
    assert u.min() >= 0.0 and u.max() < 1.0
    for column in range(3):
        counts = np.bincount((u[:, column] * 50).astype(int), minlength=50)
        expected = u.shape[0] / 50
        assert ((counts - expected) ** 2 / expected).sum() < 120    # df=49, p ~ 1e-7
    grid = u[:, 0].reshape(200, 200)
    for a, b in ((grid[:, 1:], grid[:, :-1]), (grid[1:], grid[:-1]), (u[:, 0], u[:, 1])):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.02   # 4 sigma at n=40000

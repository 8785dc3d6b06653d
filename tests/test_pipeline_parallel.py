"""Pipeline parallel (`-pp`) on simulated CPU devices.

One worker subprocess (this file run as a script, 8 simulated devices) builds each
configuration in turn and writes what the tests check to JSON: a 4-layer tiny Llama at
pp = 1, 2, 4, pp = 2 x tp = 2 with an uneven `--pp-layer-partition 1,3`, pp = 2 x dp = 2,
pp = 2 with ngram speculative decoding; a tiny Mixtral at pp = 1, 2. Every engine plans
the same small KV budget, so preemption happens, prompts are prefilled in chunks (4-token
steps), and a repeated prompt hits the prefix cache. A second batch mixes penalties,
logprobs, prompt logprobs, seeded sampling and a structured-output choice. A `jaxserve
serve -pp 2 -tp 2` process answers a chat completion and a stream; bad flags exit with
one line. Stages across processes: tests/test_pipeline_multiprocess.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import precision

REPO = Path(__file__).resolve().parents[1]
# 8 blocks of 16 tokens (one max_model_len sequence): fewer than the prompts need at once,
# so the scheduler preempts.
KV_BYTES_4_LAYERS = 8 * 2 * 4 * 16 * 2 * 16 * 4
ENGINE_KWARGS = {"max_model_len": 128, "max_num_batched_tokens": 4, "max_num_seqs": 4,
                 "enable_prefix_caching": True, **precision.EXACT}
LONG = [7] + list(range(40, 99))
PROMPTS = [[11, 23, 98], LONG, [301, 5, 44, 9, 120, 77, 6], list(range(200, 250))]
MAX_TOKENS = 8


# =================================================================================================
# The worker (a subprocess with 8 simulated devices)
# =================================================================================================
def _run(model: str, pp: int, tp: int, kv_bytes: int, mixed_batch: bool = True,
         **extra) -> dict:
    import gc

    from jaxserve import LLM, SamplingParams
    from jaxserve.structured_outputs_params import StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(model, pipeline_parallel_size=pp, tensor_parallel_size=tp,
              kv_cache_memory_bytes=kv_bytes, **ENGINE_KWARGS, **extra)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    mixed = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.3, logprobs=2),
             SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True,
                            prompt_logprobs=1),
             SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    # LONG again: its full blocks are still in the prefix cache (a prompt_logprobs request
    # would bypass it)
    mixed_out = llm.generate([LONG, [5, 6, 7], [9, 10]], mixed, use_tqdm=False) \
        if mixed_batch else []
    engine = llm.llm_engine
    runner = engine.engine_core.runner
    snapshot = engine.snapshot()
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
              "mixed": [list(o.outputs[0].token_ids) for o in mixed_out],
              "choice_text": mixed_out[2].outputs[0].text if mixed_out else None,
              "logprobs": [entry[t].logprob for t, entry in zip(
                  mixed_out[0].outputs[0].token_ids, mixed_out[0].outputs[0].logprobs)]
              if mixed_out else [],
              "prompt_logprobs": [next(iter(e.values())).logprob
                                  for e in mixed_out[1].prompt_logprobs[1:]]
              if mixed_out else [],
              "num_blocks": runner.num_blocks,
              "preemptions": snapshot.num_preemptions,
              "prefix_cache_hits": snapshot.prefix_cache_hits,
              "accepted_draft_tokens": snapshot.spec_decode_num_accepted_tokens,
              "seconds": time.perf_counter() - start}
    if pp > 1:
        result["kv_bytes_per_device"] = runner.kv_cache_bytes_per_device()
        result["stage_layers"] = [s.num_layers for s in runner.pipeline.layers]
        result["param_devices"] = [sorted({d.id for leaf in _leaves(p) for d in leaf.devices()})
                                   for p in runner.params]
    else:
        values = getattr(runner.k_cache, "data", runner.k_cache)
        result["kv_bytes_per_device"] = [2 * values.addressable_shards[0].data.nbytes]
    del llm, engine, runner
    gc.collect()
    return result


def _run_dp(model: str, kv_bytes: int) -> dict:
    """pp = 2 x dp = 2: two replicas, each two stages, on devices 0-1 and 2-3."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, pipeline_parallel_size=2, data_parallel_size=2,
              kv_cache_memory_bytes=kv_bytes, **ENGINE_KWARGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    replicas = llm.llm_engine.engine_core.replicas
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "param_devices": [[sorted({d.id for leaf in _leaves(p) for d in leaf.devices()})
                               for p in replica.runner.params] for replica in replicas],
            "requests_per_replica": list(llm.llm_engine.engine_core.num_routed)}


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def worker(spec: dict) -> None:
    import traceback

    results: dict = {}

    def section(name, fn, *args, **kwargs):
        try:
            results[name] = fn(*args, **kwargs)
        except Exception:   # noqa: BLE001 - reported to the test that needs it
            results[name] = {"error": traceback.format_exc()}
        Path(spec["out"]).write_text(json.dumps(results))

    llama, mixtral = spec["llama"], spec["mixtral"]
    for name, pp, tp, extra in [("llama_pp1", 1, 1, {}), ("llama_pp2", 2, 1, {}),
                                ("llama_pp4", 4, 1, {}),
                                ("llama_pp2_tp2_uneven", 2, 2, {"pp_layer_partition": "1,3"})]:
        section(name, _run, llama, pp, tp, KV_BYTES_4_LAYERS, **extra)
    section("llama_pp2_dp2", _run_dp, llama, KV_BYTES_4_LAYERS)
    section("llama_pp2_ngram", _run, llama, 2, 1, KV_BYTES_4_LAYERS, mixed_batch=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    for name, pp in [("mixtral_pp1", 1), ("mixtral_pp2", 2)]:
        section(name, _run, mixtral, pp, 1, KV_BYTES_4_LAYERS)


# =================================================================================================
# The tests
# =================================================================================================
def _env(num_devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    return env


@pytest.fixture(scope="module")
def results(make_tiny_model, tmp_path_factory) -> dict:
    llama = make_tiny_model("llama", num_hidden_layers=4)
    mixtral = make_tiny_model("MixtralConfig", num_hidden_layers=4, num_local_experts=4,
                              num_experts_per_tok=2, tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("pipeline") / "results.json"
    spec = {"llama": str(llama), "mixtral": str(mixtral), "out": str(out)}
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=_env(8), cwd=REPO,
                          capture_output=True, text=True, timeout=900, check=False)
    if not out.exists():
        pytest.fail(f"pipeline worker produced nothing (exit {proc.returncode}):\n"
                    f"{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


def _section(results: dict, name: str) -> dict:
    if name not in results:
        pytest.fail(f"the worker never reached {name}")
    if "error" in results[name]:
        pytest.fail(f"{name} failed in the worker:\n{results[name]['error']}")
    return results[name]


@pytest.mark.parametrize("name,reference", [
    ("llama_pp2", "llama_pp1"), ("llama_pp4", "llama_pp1"),
    ("llama_pp2_tp2_uneven", "llama_pp1"), ("mixtral_pp2", "mixtral_pp1")])
def test_pipeline_greedy_and_mixed_sampling_equal_one_stage(results, name, reference):
    ours, theirs = _section(results, name), _section(results, reference)
    assert ours["tokens"] == theirs["tokens"]
    # penalties, seeded sampling and a structured-output choice, on the last stage
    assert ours["mixed"] == theirs["mixed"]
    for key in ("logprobs", "prompt_logprobs"):     # sampled and prompt logprobs, last stage
        assert len(ours[key]) == len(theirs[key]) > 0
        assert max(abs(a - b) for a, b in zip(ours[key], theirs[key])) < 1e-3
    assert ours["choice_text"] in ("yes", "no")
    # the same small cache: the scheduler preempted in both, and the repeat hit the prefix cache
    assert ours["num_blocks"] == theirs["num_blocks"]
    assert ours["preemptions"] > 0 and ours["prefix_cache_hits"] > 0


def test_each_stage_holds_its_layers_weights_and_kv_on_its_own_devices(results):
    one, two, four = (_section(results, n) for n in ("llama_pp1", "llama_pp2", "llama_pp4"))
    (whole,) = one["kv_bytes_per_device"]
    assert two["kv_bytes_per_device"] == [whole // 2] * 2
    assert four["kv_bytes_per_device"] == [whole // 4] * 4
    assert two["param_devices"] == [[0], [1]]
    assert four["param_devices"] == [[0], [1], [2], [3]]
    assert _section(results, "llama_pp2_tp2_uneven")["param_devices"] == [[0, 1], [2, 3]]


def test_ngram_speculative_decoding_verifies_drafts_on_the_last_stage(results):
    ours = _section(results, "llama_pp2_ngram")
    assert ours["tokens"] == _section(results, "llama_pp1")["tokens"]
    assert ours["accepted_draft_tokens"] > 0


def test_pp2_dp2_replicas_each_hold_two_stages_and_serve_like_one_device(results):
    ours = _section(results, "llama_pp2_dp2")
    assert ours["tokens"] == _section(results, "llama_pp1")["tokens"]
    assert ours["param_devices"] == [[[0], [1]], [[2], [3]]]
    assert all(count > 0 for count in ours["requests_per_replica"])


def test_a_layer_partition_splits_as_given(results):
    uneven = _section(results, "llama_pp2_tp2_uneven")
    assert uneven["stage_layers"] == [1, 3]
    # a quarter of the layers, half of the KV heads (tp = 2) on each device
    quarter = _section(results, "llama_pp1")["kv_bytes_per_device"][0] // 4 // 2
    assert uneven["kv_bytes_per_device"] == [quarter, 3 * quarter]
    assert _section(results, "llama_pp2")["stage_layers"] == [2, 2]


@pytest.mark.fast
@pytest.mark.parametrize("layers,pp,partition,counts", [
    (32, 4, None, [8, 8, 8, 8]), (10, 4, None, [2, 3, 3, 2]), (7, 2, None, [4, 3]),
    (5, 3, None, [2, 2, 1]), (32, 3, "10,11,11", [10, 11, 11]), (4, 4, None, [1, 1, 1, 1])])
def test_stage_layer_counts_follow_vllms_rule(layers, pp, partition, counts):
    from jaxserve.pipeline_layout import stage_layer_counts

    assert stage_layer_counts(layers, pp, partition) == counts


@pytest.mark.fast
@pytest.mark.parametrize("layers,pp,partition,words", [
    (4, 5, None, "exceeds the model's 4 layers"), (4, 2, "3,3", "summing to the model's 4"),
    (4, 2, "1,2,1", "must name 2 stages"), (4, 2, "4,0", "at least one layer"),
    (4, 2, "a,b", "comma-separated")])
def test_bad_pipeline_splits_are_clear_errors(layers, pp, partition, words):
    from jaxserve.pipeline_layout import stage_layer_counts

    with pytest.raises(ValueError, match=words):
        stage_layer_counts(layers, pp, partition)


@pytest.mark.fast
@pytest.mark.parametrize("kwargs,words", [
    ({"speculative_config": {"method": "draft_model", "model": "m",
                             "num_speculative_tokens": 2}}, "speculative decoding by draft")])
def test_unsupported_combinations_name_themselves(kwargs, words):
    from jaxserve.config import EngineConfig
    from jaxserve.platforms import CpuPlatform

    config = EngineConfig.from_kwargs(model="m", pipeline_parallel_size=2, **kwargs)
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=2 is not supported with.*"
                                         f"{words}"):
        CpuPlatform().resolve_config(config)


@pytest.mark.fast
def test_micro_batches_split_the_running_sequences_and_take_turns():
    from jaxserve.engine.micro_batches import MicroBatches
    from tests.test_scheduler import make_scheduler, make_seq

    scheduler = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.micro_batches = MicroBatches(2, max_num_seqs=4)
    seqs = [make_seq([1, 2, 3], f"r{i}") for i in range(4)]
    for seq in seqs:
        scheduler.add_seq(seq)
    first, second = scheduler.schedule(), scheduler.schedule()   # both in flight
    assert (first.micro_batch, second.micro_batch) == (0, 1)
    # each admits its cap, ceil(4 / 2); the second never schedules the first's sequences
    assert len(first.new_seqs) == 2 and len(second.new_seqs) == 2
    assert not set(first.seq_ids) & set(second.seq_ids)
    scheduler.update_from_output(first, [7] * first.num_rows)
    third = scheduler.schedule()                 # micro-batch 0 again: its decodes only
    assert third.micro_batch == 0 and third.seq_ids == first.seq_ids
    assert third.num_scheduled_tokens == [1, 1]


@pytest.mark.parametrize("flags,words", [
    (["-pp", "8"], "pipeline_parallel_size=8 exceeds the model's 4 layers")])
def test_bad_pipeline_flags_exit_with_one_line(make_tiny_model, flags, words):
    model = make_tiny_model("llama", num_hidden_layers=4)
    proc = subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(model),
                           "--host", "127.0.0.1", "--port", "9", "--log-level", "error",
                           *flags], env=_env(8), cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_serve_pp2_tp2_answers_a_chat_completion_and_a_stream(make_tiny_model, tmp_path):
    import httpx
    import openai

    from tests.test_server import MODEL_NAME, ServerProcess

    model = make_tiny_model("llama", num_hidden_layers=4)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    server = ServerProcess(model, tmp_path / "server.log", "-pp", "2", "-tp", "2", env=env)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0,
                               timeout=120)
        messages = [{"role": "user", "content": "hello"}]
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                               max_tokens=6, temperature=0)
        assert reply.usage.completion_tokens == 6 or reply.choices[0].finish_reason == "stop"
        text = reply.choices[0].message.content
        stream = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=6, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices)
        assert streamed == text and text
        body = httpx.get(server.url + "/metrics", timeout=30).text
        generated = [line for line in body.splitlines()
                     if line.startswith("jaxserve:generation_tokens_total")]
        assert generated and float(generated[0].split()[-1]) >= 12
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))

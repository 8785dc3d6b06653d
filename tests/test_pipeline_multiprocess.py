"""Pipeline stages across processes: `--num-processes 2 -pp 2` over jax.distributed.

Real processes on loopback (gloo collectives on CPU), a 4-layer tiny Llama, float32:

* the single-process reference (pp = 1, one device) generates greedy tokens once;
* two processes with two simulated devices each run pp = 2 x tp = 2 (a stage per process,
  tensor parallel inside it) and pp = 4 (two stages per process) through `LLM` and must
  give the same tokens;
* `jaxserve serve --num-processes 2 -pp 2` (a stage per process): process 0 answers
  completions (the reference's text), a chat completion and its stream; SIGTERM ends both
  processes with status 0;
* a layout that cannot run across processes fails in both processes with one line.

This file run as a script is one process of such a run (see `generate`).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import precision
from tests.test_parallel import _free_port, _post, _wait_healthy

REPO = Path(__file__).resolve().parents[1]
KV_BYTES = 8 * 2 * 4 * 16 * 2 * 16 * 4     # 8 blocks of 16 tokens at pp = 1 (4 layers)
ENGINE_ARGS = {"max_model_len": 128, "max_num_batched_tokens": 4, "max_num_seqs": 4,
               "kv_cache_memory_bytes": KV_BYTES, **precision.EXACT}
PROMPTS = [[11, 23, 98], [7] + list(range(40, 70)), [301, 5, 44, 9, 120, 77, 6]]
MAX_TOKENS = 8


# =================================================================================================
# One process of a run (this file as a script)
# =================================================================================================
def generate(spec: dict) -> None:
    """Greedy tokens of PROMPTS written to spec["out"]; with spec["rank"], one process of a
    two-process run (a follower follows the leader's steps inside LLM() and exits 0)."""
    from jaxserve import LLM, SamplingParams

    kwargs = dict(ENGINE_ARGS, pipeline_parallel_size=spec["pp"],
                  tensor_parallel_size=spec["tp"])
    if spec.get("rank") is not None:
        kwargs.update(num_processes=2, process_id=spec["rank"],
                      coordinator_address=spec["coordinator"])
    llm = LLM(spec["model"], **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    # The last stage's sampling state (penalty history, seeds) and prompt logprobs, which
    # come back to the leader with the return hop.
    mixed = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.3),
             SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True,
                            prompt_logprobs=1)]
    mixed_out = llm.generate(PROMPTS[:2], mixed, use_tqdm=False)
    Path(spec["out"]).write_text(json.dumps({
        "tokens": [list(c.token_ids) for c in completions],
        "texts": [c.text for c in completions],
        "logprobs": [[entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
                     for c in completions],
        "mixed": [list(o.outputs[0].token_ids) for o in mixed_out],
        "prompt_logprobs": [next(iter(e.values())).logprob
                            for e in mixed_out[1].prompt_logprobs[1:]]}))


# =================================================================================================
# The tests
# =================================================================================================
from tests.test_pipeline_parallel import _env  # noqa: E402  (a process's simulated devices)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tiny_model(make_tiny_model) -> Path:
    return make_tiny_model("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> dict:
    """pp = 1 on one device, in one process."""
    out = tmp_path_factory.mktemp("pp_reference") / "reference.json"
    spec = {"model": str(tiny_model), "pp": 1, "tp": 1, "out": str(out)}
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=_env(1), cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False)
    if not out.exists():
        pytest.fail(f"the reference run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("pp,tp", [(2, 2), (4, 1)])
def test_two_processes_generate_one_processs_tokens(tiny_model, reference, tmp_path, pp, tp):
    """pp = 2 x tp = 2: a stage per process, tensor parallel inside it; pp = 4: two stages
    per process (hidden states hop within a process, then across)."""
    coordinator = f"127.0.0.1:{_free_port()}"
    out = tmp_path / "tokens.json"
    logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
    procs = []
    for rank, log in enumerate(logs):
        spec = {"model": str(tiny_model), "pp": pp, "tp": tp, "rank": rank,
                "coordinator": coordinator, "out": str(out)}
        procs.append(subprocess.Popen([sys.executable, __file__, json.dumps(spec)],
                                      env=_env(2), cwd=REPO, stdout=log.open("w"),
                                      stderr=subprocess.STDOUT))
    try:
        # The follower exits 0 only after the leader's STOP (distributed.follow)
        codes = [proc.wait(timeout=600) for proc in procs]
        assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
        ours = json.loads(out.read_text())
        assert ours["tokens"] == reference["tokens"]
        for mine, theirs in zip(ours["logprobs"], reference["logprobs"]):
            assert max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-3
        assert ours["mixed"] == reference["mixed"]     # penalties, a seeded sample
        assert len(ours["prompt_logprobs"]) == len(PROMPTS[1]) - 1
        assert max(abs(a - b) for a, b in zip(ours["prompt_logprobs"],
                                              reference["prompt_logprobs"])) < 1e-3
    finally:
        _stop(procs)


def test_serve_with_a_stage_per_process_answers_and_sigterm_ends_both(tiny_model, reference,
                                                                      tmp_path):
    import openai

    coordinator, port = _free_port(), _free_port()
    common = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(tiny_model),
              "--num-processes", "2", "--coordinator-address", f"127.0.0.1:{coordinator}",
              "-pp", "2", "--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len", "128",
              "--max-num-batched-tokens", "4", "--max-num-seqs", "4", "--disable-log-stats",
              "--served-model-name", "tiny", "--dtype", precision.EXACT["dtype"]]
    logs = [tmp_path / "leader.log", tmp_path / "follower.log"]
    procs = []
    for rank, log in enumerate(logs):
        extra = ["--process-id", str(rank)] + (["--port", str(port)] if rank == 0 else [])
        procs.append(subprocess.Popen(common + extra, env=_env(1), cwd=REPO,
                                      stdout=log.open("w"), stderr=subprocess.STDOUT))
    leader, follower = procs
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(f"{url}/health", procs, timeout=600)
        for prompt, text in zip(PROMPTS, reference["texts"]):
            body = _post(f"{url}/v1/completions",
                         {"model": "tiny", "prompt": prompt, "temperature": 0,
                          "max_tokens": MAX_TOKENS, "ignore_eos": True})
            assert body["choices"][0]["text"] == text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0,
                               timeout=120)
        messages = [{"role": "user", "content": "hello"}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                               temperature=0)
        text = reply.choices[0].message.content
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                           if chunk.choices)
        assert text and streamed == text
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(timeout=60) == 0
        assert follower.wait(timeout=60) == 0, "the follower should stop with the leader"
        assert "the leader stopped" in logs[1].read_text()
    except BaseException:
        for log in logs:
            sys.stderr.write(f"--- {log.name}\n{log.read_text()[-3000:]}\n")
        raise
    finally:
        _stop(procs)


def test_a_layout_that_cannot_run_across_processes_fails_in_both_with_one_line(tiny_model):
    """-pp 2 -tp 2 on two processes of one device each (check_stages_in_processes's other
    error is checked without processes below)."""
    coordinator = f"127.0.0.1:{_free_port()}"
    words = ("a multi-process run must use every device: pipeline_parallel_size (2) x "
             "tensor_parallel_size (2)")
    procs = []
    for rank in range(2):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(tiny_model),
             "--num-processes", "2", "--process-id", str(rank), "--coordinator-address",
             coordinator, "-pp", "2", "-tp", "2", "--host", "127.0.0.1",
             "--port", str(_free_port()), "--uvicorn-log-level", "warning"],
            env=_env(1), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True))
    try:
        for proc in procs:
            _, stderr = proc.communicate(timeout=300)
            errors = [line for line in stderr.splitlines() if "error" in line.lower()]
            assert proc.returncode == 2, stderr[-3000:]
            assert len(errors) == 1 and words in errors[0], stderr[-3000:]
            assert "Traceback" not in stderr
    finally:
        _stop(procs)


@pytest.mark.fast
@pytest.mark.parametrize("per_process,pp,tp,words", [
    ((1, 3), 2, 2, "pipeline stage 0's 2 devices would span processes [0, 1]: a stage's devices "
                   "must be in one process, so tensor_parallel_size (2) must divide"),
    ((2, 2), 2, 1, "must use every device: pipeline_parallel_size (2) x tensor_parallel_size "
                   "(1) x data_parallel_size (1) = 2, but the 2 processes have 4 devices"),
    ((2, 2), 2, 2, None), ((2, 2), 4, 1, None), ((1, 1), 2, 1, None)])
def test_stages_across_processes_must_use_every_device_each_in_one_process(per_process, pp,
                                                                          tp, words):
    from types import SimpleNamespace

    from jaxserve.pipeline_layout import check_stages_in_processes

    devices = [SimpleNamespace(id=1000 * rank + i, process_index=rank)
               for rank, count in enumerate(per_process) for i in range(count)]
    if words is None:
        check_stages_in_processes(pp, tp, devices)
    else:
        with pytest.raises(ValueError, match=re.escape(words)):
            check_stages_in_processes(pp, tp, devices)


@pytest.mark.fast
@pytest.mark.parametrize("kwargs,words", [
    ({"pipeline_micro_batches": 2}, "pipeline_micro_batches=2 across processes"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative decoding across processes"),
    ({"enable_lora": True}, "enable_lora across processes"),
    ({"aot_dir": "/aot"}, "aot_dir across processes")])
def test_what_pipelines_across_processes_do_not_run_is_named(kwargs, words):
    from jaxserve.config import EngineConfig
    from jaxserve.platforms import CpuPlatform

    config = EngineConfig.from_kwargs(model="m", pipeline_parallel_size=2, num_processes=2,
                                      **kwargs)
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=2 is not supported with "
                                         f".*{words}"):
        CpuPlatform().resolve_config(config)


@pytest.mark.fast
def test_pipelines_across_processes_default_to_one_micro_batch():
    from jaxserve.config import EngineConfig
    from jaxserve.platforms import CpuPlatform

    config = CpuPlatform().resolve_config(EngineConfig.from_kwargs(
        model="m", pipeline_parallel_size=2, num_processes=2))
    assert config.parallel_config.pipeline_micro_batches == 1


if __name__ == "__main__":
    generate(json.loads(sys.argv[1]))

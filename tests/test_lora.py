"""Multi-LoRA serving (jaxserve/lora): parity with HF + PEFT, batches mixing adapters, slots
swapped without compiles, bad adapters rejected at load."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers

from jaxserve import LLM, LoRARequest, SamplingParams
from tests import precision
from tests.hf_reference import hf_greedy, hf_logits
from tests.lora_adapters import ALL_TARGETS, ATTENTION_TARGETS, make_peft_adapter
from tests.test_parity import TEXTS

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]

NEW_TOKENS = 32
GEMMA3 = ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 24,
                               "sliding_window": 8, "tie_word_embeddings": True})
QWEN3_MOE = ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64, "head_dim": 16,
                                "norm_topk_prob": True, "tie_word_embeddings": True})
# family -> (make_tiny_model args, targets its adapters adapt)
FAMILIES = {"llama": (("llama", {}), ALL_TARGETS),
            "qwen3": (("qwen3", {}), ALL_TARGETS),
            "gemma3": (GEMMA3, ALL_TARGETS)}
# Qwen3-MoE with attention targets passed the same test (not run by default: one more engine
# compile); its expert MLPs are a clear error (test_moe_expert_targets_are_a_clear_error).


def _greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tiny_llm(model_dir, **kwargs) -> LLM:
    options = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                   kv_cache_memory_bytes=2 << 20, enable_lora=True, max_lora_rank=16,
                   **precision.EXACT)       # against PEFT / numpy: float32 on every box
    return LLM(str(model_dir), **(options | kwargs))


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
    # Few step buckets (compile time): 4 rows of at most 16 tokens. Decode rows on the CPU
    # library's GEMV (a tiny model would keep oneDNN, untimed): q/k/v and gate/up then come
    # from one grouped call each, every adapter's delta added per projection after it.
    llm = _tiny_llm(model_dir, max_loras=2, max_num_seqs=4, max_num_batched_tokens=16,
                    cpu_gemv_rows="8")
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
    # One batch: every prompt under both adapters together.
    jobs = [(ids, lora, hf) for ids in prompts for lora, hf in adapters]
    outs = llm.generate([j[0] for j in jobs], _greedy(), use_tqdm=False,
                        lora_request=[j[1] for j in jobs])
    for (ids, _, hf), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, NEW_TOKENS)
    from jaxserve.kernels.cpu import matmul
    runner = llm.llm_engine.engine_core.runner
    if jax.default_backend() == "cpu" and matmul.available():   # the grouped GEMV was the path
        decode = runner._steps[min(runner._steps)].as_text()
        assert matmul.GROUP_TARGET in decode, name
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
    with pytest.raises(ValueError, match="expert MLP adapters.* not supported"):
        load_peft_adapter(str(tmp_path), family_for(arch.architecture), arch, 16)


def test_lora_step_exports_for_cuda(make_tiny_model):
    """The step with adapter slots lowers for GPU too (jax.export, no GPU needed)."""
    from tests.test_step_lowering import cuda_runner

    _, runner = cuda_runner(make_tiny_model("llama"), enable_lora=True, max_loras=2,
                            max_lora_rank=8)
    stacks = runner.lora.arrays
    assert stacks["q_proj"]["lora_a"].shape == (2, 3, 64, 8)       # [L, max_loras + 1, in, r]
    assert stacks["down_proj"]["lora_b"].dtype.name == "bfloat16"
    t, s = runner.buckets.all_shapes()[-1]
    exported = runner.export_step(t, s, "cuda")
    shapes = [tuple(a.shape) for a in exported.in_avals]
    assert (2, 3, 128, 8) in shapes and (2, 3, 8, 64) in shapes      # down_proj's A and B


# -- one engine for the serving behaviour: tiny Llama, 2 slots, 3 adapters + the base model ------
MIXED_TEXTS = ["Hello, world! How are you", "Paged attention stores the key-value cache",
               "def add(a, b):", "Continuous batching lets new requests join"]


@pytest.fixture(scope="module")
def served(make_tiny_model, tmp_path_factory):
    """(llm, model_dir, adapters {name: LoRARequest}, root): ranks 4 / 8 / 16, different
    targets; max_loras=2, so a batch using all three must make one adapter wait."""
    model_dir = make_tiny_model("llama")
    root = tmp_path_factory.mktemp("lora_served")
    specs = {"sql": (4, 16, ALL_TARGETS), "chat": (8, 4, ATTENTION_TARGETS),
             "poem": (16, 32, ("q_proj", "v_proj", "down_proj"))}
    adapters = {}
    for i, (name, (rank, alpha, targets)) in enumerate(specs.items()):
        make_peft_adapter(model_dir, root / name, rank=rank, alpha=alpha, targets=targets,
                          seed=10 + i, std=0.1)
        adapters[name] = LoRARequest(name, i + 1, str(root / name))
    llm = _tiny_llm(model_dir, max_loras=2, max_cpu_loras=3)
    return llm, model_dir, adapters, root


class _SlotRecorder:
    """Wraps the runner's execute: the distinct adapter slots each step runs, and loads."""

    def __init__(self, runner) -> None:
        self.runner, self.steps, self.loads = runner, [], 0
        self._execute = runner.execute
        runner.execute = self

    def __call__(self, out):
        slots = set()
        for new in out.new_seqs:
            slots.add(new.adapter_slot)
        batch = self.runner.batch
        result = self._execute(out)
        rows = [batch.row_of[s] for s in out.seq_ids if s in batch.row_of]
        slots |= {int(batch.lora_slot[r]) for r in rows}
        self.steps.append(slots - {0})
        self.loads += len(out.lora_loads)
        return result

    def close(self) -> None:
        self.runner.execute = self._execute


def test_batch_mixing_base_and_three_adapters_equals_each_alone(served):
    from tests.test_quantization import compile_events

    llm, _, adapters, _ = served
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in MIXED_TEXTS]
    loras = [None, adapters["sql"], adapters["chat"], adapters["poem"]]
    alone = [llm.generate([p], _greedy(16), use_tqdm=False, lora_request=[lora])[0]
             for p, lora in zip(prompts, loras)]
    recorder = _SlotRecorder(llm.llm_engine.engine_core.runner)
    try:
        with compile_events() as compiles:
            mixed = llm.generate(prompts * 2, _greedy(16), use_tqdm=False,
                                 lora_request=loras * 2)
    finally:
        recorder.close()
    tokens = [o.outputs[0].token_ids for o in alone]
    assert len({tuple(t) for t in tokens}) == 4         # the adapters change the output
    assert [o.outputs[0].token_ids for o in mixed] == tokens * 2
    assert compiles == []                                # slot swaps are device updates
    assert max(len(s) for s in recorder.steps) == 2     # max_loras distinct adapters per step
    assert recorder.loads >= 1                           # the third adapter waited for a slot


def test_prefix_cache_never_shares_kv_across_adapters(served):
    llm, _, adapters, _ = served
    blocks = llm.llm_engine.engine_core.block_manager
    prompt = list(range(40, 40 + 3 * blocks.block_size + 1))

    def hits(lora) -> int:
        before = blocks.prefix_cache_hits
        llm.generate([prompt], _greedy(1), use_tqdm=False, lora_request=lora)
        return blocks.prefix_cache_hits - before

    assert hits(adapters["sql"]) == 0
    assert hits(adapters["chat"]) == 0                    # same prompt, another adapter
    assert hits(None) == 0                                # ... and the base model
    assert hits(adapters["sql"]) == 3 * blocks.block_size  # the same adapter does hit


def test_bad_adapters_are_value_errors_naming_the_problem(served, make_tiny_model, tmp_path):
    from safetensors.numpy import load_file, save_file

    llm, model_dir, adapters, root = served
    engine = llm.llm_engine
    big = make_peft_adapter(model_dir, tmp_path / "r32", rank=32, alpha=32)
    del big
    other = make_tiny_model("qwen3")            # head_dim 32: q_proj is 64 -> 128 there
    make_peft_adapter(other, tmp_path / "qwen3", rank=4, alpha=8)
    renamed = tmp_path / "unknown"
    renamed.mkdir()
    (renamed / "adapter_config.json").write_text((root / "sql" / "adapter_config.json")
                                                 .read_text())
    tensors = load_file(str(root / "sql" / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "qkv_proj"): v for k, v in tensors.items()},
              str(renamed / "adapter_model.safetensors"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    cases = {"r32": "rank r=32 is outside", "qwen3": "has shape .* expected",
             "unknown": "target module 'qkv_proj'", "empty": "adapter_model.safetensors is missing",
             "nowhere": "is not a directory"}
    for i, (name, message) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            engine.add_request(f"bad-{name}", "Hello", _greedy(2),
                               lora_request=LoRARequest(name, 100 + i, str(tmp_path / name)))
    assert not engine.has_unfinished_requests()          # nothing half-added
    out = llm.generate(["Hello"], _greedy(4), use_tqdm=False, lora_request=adapters["sql"])
    assert len(out[0].outputs[0].token_ids) == 4          # still serving


def _mixed_batch_on_two_devices(served, tmp_path, **parallel) -> tuple[dict, list]:
    """The worker's result on 2 simulated CPU devices (a subprocess: JAX fixes its devices at
    start) for a batch mixing the base model and three adapters, and the one-device tokens."""
    llm, model_dir, adapters, _ = served
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in MIXED_TEXTS]
    names = [None, "sql", "chat", "poem"]
    expected = [o.outputs[0].token_ids for o in llm.generate(
        prompts, _greedy(12), use_tqdm=False,
        lora_request=[adapters[n] if n else None for n in names])]
    spec = {"model": str(model_dir), "prompts": prompts, "names": names,
            "adapters": {n: [r.lora_int_id, r.lora_path] for n, r in adapters.items()},
            "parallel": parallel, "out": str(tmp_path / "parallel.json")}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / "parallel.json").read_text()), expected


def test_tensor_parallel_mixed_batch_equals_one_device(served, tmp_path):
    """tp=2: A/B split like their base kernels, the same tokens as one device for a batch
    mixing adapters."""
    result, expected = _mixed_batch_on_two_devices(served, tmp_path, tensor_parallel_size=2)
    stacks = result["specs"][0]
    assert stacks["lora_b_q"] == [None, None, None, "model"]    # column-parallel: B on out
    assert stacks["lora_a_o"] == [None, None, "model", None]    # row-parallel: A on in
    assert result["tokens"] == expected


def test_pipeline_parallel_mixed_batch_equals_one_device(served, tmp_path):
    """pp=2: each stage holds its own layers' adapter slices (1 of the tiny model's 2 layers,
    on its own device) and applies them in its own program; the same tokens as one device for
    a batch mixing the base model and three adapters (one waits for a slot)."""
    result, expected = _mixed_batch_on_two_devices(served, tmp_path, pipeline_parallel_size=2)
    assert [s["layers"] for s in result["specs"]] == [1, 1]
    assert [s["devices"] for s in result["specs"]] == [[0], [1]]
    assert result["tokens"] == expected


def _parallel_worker(spec: dict) -> None:
    llm = LLM(spec["model"], max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              kv_cache_memory_bytes=2 << 20, enable_lora=True, max_lora_rank=16, max_loras=2,
              **spec["parallel"], **precision.EXACT)
    adapters = {n: LoRARequest(n, i, p) for n, (i, p) in spec["adapters"].items()}
    outs = llm.generate(spec["prompts"], _greedy(12), use_tqdm=False,
                        lora_request=[adapters[n] if n else None for n in spec["names"]])
    stacks = llm.llm_engine.engine_core.runner.lora.arrays
    # one dict of stacks per pipeline stage (pp = 1: the one)
    specs = [{"lora_b_q": list(s["q_proj"]["lora_b"].sharding.spec),
              "lora_a_o": list(s["o_proj"]["lora_a"].sharding.spec),
              "layers": s["q_proj"]["lora_a"].shape[0],
              "devices": sorted(d.id for d in s["q_proj"]["lora_a"].sharding.device_set)}
             for s in (stacks if isinstance(stacks, list) else [stacks])]
    with open(spec["out"], "w") as f:
        json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "specs": specs}, f)


def test_unloading_an_adapter_lets_its_running_requests_finish(served):
    """vLLM's unload: the name leaves the registry at once; a request already running under
    it keeps its weights (it holds them) and finishes with the same tokens."""
    llm, _, adapters, root = served
    engine, registry = llm.llm_engine, llm.llm_engine.engine_core.lora_registry
    prompt = llm.get_tokenizer().encode(MIXED_TEXTS[2])
    expected = llm.generate([prompt], _greedy(12), use_tqdm=False,
                            lora_request=adapters["chat"])[0].outputs[0].token_ids
    registry.add(LoRARequest("temp", 77, str(root / "chat")))
    engine.add_request("inflight", None, _greedy(12), prompt_token_ids=prompt,
                       lora_request=registry.lookup("temp"))
    outputs = engine.step() + engine.step()
    registry.remove("temp")
    assert registry.lookup("temp") is None and "temp" not in registry.cached_names()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [o for o in outputs if o.finished]
    assert [o.outputs[0].token_ids for o in final] == [expected]


def test_lora_slots_keep_idle_adapters_and_evict_the_least_recently_used():
    from jaxserve.lora.slots import LoRASlots

    slots = LoRASlots(2)
    assert slots.acquire("a") == (1, True) and slots.acquire("b") == (2, True)
    assert slots.acquire("c") is None                 # both referenced: c waits
    assert slots.acquire("a") == (1, False)           # a second user needs no write
    slots.release(2)                                  # b idle, still loaded
    assert slots.acquire("b") == (2, False)
    slots.release(2)
    slots.release(1)
    slots.release(1)                                  # a goes idle after b
    assert slots.acquire("c") == (2, True)            # evicts b, the least recently used
    assert slots.slot_of("b") is None and slots.slot_of("a") == 1
    assert slots.num_active == 1


# -- the server: --lora-modules, /v1/models, runtime load / unload, errors, metrics ---------------
def test_server_loads_serves_unloads_and_reuses_slots_without_compiles(served, tmp_path):
    """Last in this module: the engine moves into a server thread here."""
    import httpx

    from tests.test_quantization import compile_events
    from tests.test_server_fake_engine import ServerThread

    llm, model_dir, adapters, root = served
    tok = llm.get_tokenizer()
    prompt = tok.encode(MIXED_TEXTS[0])
    expected = {name: llm.generate([prompt], _greedy(8), use_tqdm=False,
                                   lora_request=lora)[0].outputs[0].token_ids
                for name, lora in [("base", None), *adapters.items()]}
    make_peft_adapter(model_dir, tmp_path / "r32", rank=32, alpha=32)
    with compile_events() as compiles:
        server = ServerThread(llm.llm_engine.engine_core, lora_modules=[f"sql={root / 'sql'}"],
                              allow_runtime_lora_updating=True)
        try:
            _serve_and_swap(server, httpx, prompt, expected, root, tmp_path)
        finally:
            server.stop()
    assert compiles == []


def _serve_and_swap(server, httpx, prompt, expected, root, tmp_path) -> None:
    def complete(model: str, max_tokens: int = 8) -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=60)

    models = httpx.get(server.url + "/v1/models").json()["data"]
    base_name = models[0]["id"]
    assert [(m["id"], m["parent"]) for m in models] == [(base_name, None), ("sql", base_name)]
    assert complete("sql").json()["choices"][0]["text"] == _text(expected["sql"])
    assert complete(base_name).json()["choices"][0]["text"] == _text(expected["base"])

    # Runtime loading: a good adapter serves at once; bad ones are 400s in OpenAI's shape.
    assert post("/v1/load_lora_adapter", {"lora_name": "chat",
                                          "lora_path": str(root / "chat")}).status_code == 200
    for body, message in (({"lora_name": "big", "lora_path": str(tmp_path / "r32")}, "rank"),
                          ({"lora_name": "gone", "lora_path": str(tmp_path / "x")}, "directory"),
                          ({"lora_name": "chat", "lora_path": str(root / "chat")}, "already")):
        response = post("/v1/load_lora_adapter", body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    assert complete("chat").json()["choices"][0]["text"] == _text(expected["chat"])

    # Unload while a request of that adapter streams: it finishes with all its tokens; the
    # name is a 404 from then on.
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": "sql", "prompt": prompt, "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) \
            as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
        rest = [line for line in lines if line.startswith("data:")]
    usage = [json.loads(line[5:])["usage"] for line in [first, *rest]
             if line != "data: [DONE]" and json.loads(line[5:]).get("usage")]
    assert usage[-1]["completion_tokens"] == 100
    response = complete("sql")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert post("/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 404

    # Another adapter takes the freed slot (max_loras=2: chat holds the other).
    assert post("/v1/load_lora_adapter", {"lora_name": "poem",
                                          "lora_path": str(root / "poem")}).status_code == 200
    assert complete("poem").json()["choices"][0]["text"] == _text(expected["poem"])
    assert complete("chat").json()["choices"][0]["text"] == _text(expected["chat"])
    metrics = httpx.get(server.url + "/metrics").text
    assert 'jaxserve:lora_requests_info{max_lora="2"' in metrics


_TOKENIZER = None


def _text(token_ids: list[int]) -> str:
    return _TOKENIZER.decode(token_ids)


@pytest.fixture(autouse=True, scope="module")
def _tokenizer(make_tiny_model):
    global _TOKENIZER
    _TOKENIZER = transformers.AutoTokenizer.from_pretrained(make_tiny_model("llama"))


if __name__ == "__main__":
    _parallel_worker(json.loads(sys.argv[1]))

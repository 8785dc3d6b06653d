"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers, on tiny random configs.

Windows of 8 tokens: every parity prompt but the first is longer than the window, and
the 32 greedy tokens run far past it; 3 layers mix local (sliding) and global layers.
"""

from __future__ import annotations

import copy
import logging

import jax
import numpy as np
import pytest
import transformers

from jaxserve import LLM, SamplingParams
from tests import precision
from tests.hf_reference import hf_logits
from tests.test_parity import TEXTS, _check_parity

logger = logging.getLogger(__name__)

WINDOW = 8
# (transformers config class, overrides); make_tiny_model adds the common tiny sizes.
GEMMA2 = ("Gemma2Config", {
    "head_dim": 16, "num_hidden_layers": 3, "query_pre_attn_scalar": 24,
    "sliding_window": WINDOW, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
    "tie_word_embeddings": True})
GEMMA3 = ("Gemma3TextConfig", {
    "head_dim": 16, "num_hidden_layers": 3, "query_pre_attn_scalar": 24,
    "sliding_window": WINDOW, "tie_word_embeddings": True,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    # local layers: their own base; global layers: a different base with linear scaling
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1000000.0}}})
CONFIGS = {"gemma2_softcap": GEMMA2, "gemma3": GEMMA3}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma(request, make_tiny_model):
    config_class, overrides = CONFIGS[request.param]
    model_dir = make_tiny_model(config_class, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              kv_cache_memory_bytes=2 << 20, **precision.EXACT)
    return request.param, model_dir, hf, llm


@pytest.mark.engine
def test_gemma_logits_and_greedy_tokens_match_hf(gemma):
    name, _, hf, llm = gemma
    assert type(hf).__name__ in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    assert llm.llm_engine.engine_core.setup.arch.layer_windows == (WINDOW, 0, WINDOW)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    assert sum(len(p) > WINDOW for p in prompts) >= 3
    worst = _check_parity(llm, hf, prompts, logits_tol=1e-4)
    logger.warning("%s: max |logits - HF| = %.2e", name, worst)


def test_gemma_serving_compiles_nothing_after_warmup(gemma):
    _, _, _, llm = gemma
    compiles = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 300, size=int(n)).tolist() for n in rng.integers(2, 60, 7)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(1, 20, len(prompts))]
    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


def test_gemma2_soft_caps_and_gemma3_local_rope_change_hf_logits(make_tiny_model):
    # The parity above would be vacuous if the configs' special features did nothing.
    ids = list(range(3, 40))
    for (config_class, overrides), changes in (
            (GEMMA2, {"attn_logit_softcapping": None}),
            (GEMMA2, {"final_logit_softcapping": None}),
            (GEMMA3, {"rope_parameters": {**GEMMA3[1]["rope_parameters"],
                                          "sliding_attention": GEMMA3[1]["rope_parameters"][
                                              "full_attention"]}})):
        model_dir = make_tiny_model(config_class, **overrides)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
        config = copy.deepcopy(hf.config)
        for key, value in changes.items():
            setattr(config, key, value)
        other = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, config=config, dtype="float32").eval()
        assert np.abs(hf_logits(hf, ids) - hf_logits(other, ids)).max() > 1e-3, changes


def write_gemma_gguf(model_dir, path, gguf_arch: str) -> None:
    """A float32 GGUF of a tiny Gemma, written as llama.cpp's converter does: its tensor
    names, norm weights stored as 1 + w, soft caps, window and (Gemma 3) window pattern."""
    import gguf
    import torch

    from jaxserve.models.gemma import FAMILY

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    c = model.config
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    if gguf_arch == "gemma2":
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        full = c.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    hf_to_gguf = {hf: g for hf, g in FAMILY.layer_tensors.values()}
    for name, tensor in model.state_dict().items():
        value = tensor.numpy()
        if name.endswith("norm.weight"):
            value = value + 1.0            # llama.cpp: Gemma norms are stored as 1 + w
        if name == "lm_head.weight":
            continue                       # tied
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            writer.add_tensor("token_embd.weight" if "embed" in name else "output_norm.weight",
                              value)
            continue
        layer, suffix = name.split(".", 3)[2:]
        writer.add_tensor(f"blk.{layer}.{hf_to_gguf[suffix]}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("config, gguf_arch", [(GEMMA2, "gemma2"), (GEMMA3, "gemma3")])
def test_gemma_gguf_written_like_llama_cpp_loads_like_the_safetensors(make_tiny_model, tmp_path,
                                                                      config, gguf_arch):
    from jaxserve.loader import load_model
    from jaxserve.models.registry import read_arch

    # GGUF does not store query_pre_attn_scalar: llama.cpp derives head_dim (below 27B).
    config_class, overrides = config
    model_dir = make_tiny_model(config_class, **{**overrides, "query_pre_attn_scalar": 16})
    path = tmp_path / f"{gguf_arch}.gguf"
    write_gemma_gguf(model_dir, path, gguf_arch)
    from_gguf = load_model(str(path), tokenizer=str(model_dir))
    from_safetensors = load_model(str(model_dir))
    assert from_gguf.architecture == from_safetensors.architecture
    assert sorted(from_gguf.weights) == sorted(from_safetensors.weights)
    for name, value in from_safetensors.weights.items():   # norms went through (1 + w) - 1
        np.testing.assert_allclose(from_gguf.weights[name], value, atol=1e-6, err_msg=name)
    ours, theirs = read_arch(from_gguf.hf_config), read_arch(from_safetensors.hf_config)
    assert ours.layer_windows == theirs.layer_windows == (WINDOW, 0, WINDOW)
    for field in ("sm_scale", "attn_logit_soft_cap", "final_logit_soft_cap", "ropes",
                  "layer_rope", "qk_norm", "activation"):
        assert getattr(ours.options, field) == pytest.approx(getattr(theirs.options, field)), \
            field


def test_gemma2_step_with_traced_windows_and_soft_caps_exports_for_cuda(make_tiny_model):
    # No GPU here: the Pallas kernel with a per-layer (scanned) window and a soft cap must
    # still lower through Triton inside the whole step.
    from tests.test_step_lowering import TRITON, cuda_runner

    _, runner = cuda_runner(make_tiny_model(GEMMA2[0], **GEMMA2[1]))
    assert runner.model.backend.name == "pallas"
    shapes = runner.buckets.all_shapes()
    for num_tokens, num_seqs in (shapes[0], shapes[-1]):
        assert TRITON in runner.export_step(num_tokens, num_seqs, "cuda").mlir_module()


_TP_SCRIPT = """
import json, sys
from jaxserve import LLM, SamplingParams
model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
tokens = {}
for tp in (1, 2):
    llm = LLM(model_dir, tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, kv_cache_memory_bytes=2 << 20, dtype="float32")
    tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print("TOKENS" + json.dumps(tokens))
"""


def test_gemma2_tensor_parallel_greedy_tokens_equal_one_device(make_tiny_model):
    # Megatron rules from the family, the per-layer window and the soft cap through
    # shard_map: tp = 2 on two simulated CPU devices gives tp = 1's greedy tokens.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model_dir = make_tiny_model(GEMMA2[0], **GEMMA2[1])
    prompts = [[11, 23, 98], list(range(40, 77)), [301, 5, 44, 9, 120, 77, 6, 3, 8, 9, 10]]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(model_dir), json.dumps(prompts)],
                          env=env, cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS")]
    assert lines, proc.stderr[-3000:]
    tokens = json.loads(lines[-1][len("TOKENS"):])
    assert tokens["2"] == tokens["1"]
    assert all(len(t) == 12 for t in tokens["1"])


def test_gemma2_greedy_tokens_equal_on_every_cpu_runnable_backend(make_tiny_model):
    # Parity above runs the `cpu` (C++) backend; the jnp reference and the Pallas kernel
    # (interpret mode) must give the same tokens with per-layer windows and soft caps.
    model = str(make_tiny_model(GEMMA2[0], **GEMMA2[1]))
    prompts = [[11, 23, 98, 421, 77], list(range(5, 27)), [300, 301]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for backend in ("cpu", "reference", "pallas-interpret"):
        llm = LLM(model, attention_backend=backend, max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20, **precision.EXACT)
        outputs[backend] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["reference"] == outputs["cpu"]
    assert outputs["pallas-interpret"] == outputs["cpu"]

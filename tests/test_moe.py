"""Mixture of experts (models/moe.py, Mixtral, Qwen3-MoE) against Hugging Face transformers
on tiny random configs (4 experts, top-2, 2 layers), and sharded over simulated devices:
tensor parallel and expert parallel give the one-device greedy tokens, the EP step's HLO
exchanges no expert weights, and each device holds 1/ep of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.models import moe
from jaxserve.models.layers import ACTIVATIONS
from tests import precision
from tests.test_parity import TEXTS, _check_parity

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
# (transformers config class, overrides); make_tiny_model adds hidden 64, 4 heads, 2 KV heads.
MIXTRAL = ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                             "intermediate_size": 64, "tie_word_embeddings": False})
QWEN3_MOE = ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64, "head_dim": 16,
                                "norm_topk_prob": True, "tie_word_embeddings": True})
CONFIGS = {"mixtral": MIXTRAL, "qwen3_moe": QWEN3_MOE}


# -- the block's parts, against their references ------------------------------------------------
def test_router_weights_and_choices_match_hf_routers():
    rng = np.random.default_rng(0)
    hidden, experts, tokens = 16, 6, 9
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    w = rng.standard_normal((experts, hidden)).astype(np.float32)
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cases = [(MixtralTopKRouter(transformers.MixtralConfig(
        hidden_size=hidden, num_local_experts=experts, num_experts_per_tok=3)), True)]
    for norm in (True, False):
        cases.append((Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(
            hidden_size=hidden, num_experts=experts, num_experts_per_tok=3,
            norm_topk_prob=norm)), norm))
    for router, renormalize in cases:
        with torch.no_grad():
            router.weight.copy_(torch.from_numpy(w))
            _, hf_weights, hf_experts = router(torch.from_numpy(x))
        weights, chosen = moe.route(jnp.asarray(x @ w.T), 3, renormalize)
        np.testing.assert_array_equal(np.asarray(chosen), hf_experts.numpy())
        np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), atol=1e-6)
        assert np.allclose(np.asarray(weights).sum(-1), 1.0) == renormalize


def dense_moe_reference(x, weights, experts, w_gate, w_up, w_down, activation: str = "silu"):
    """Every expert on every token, weighted by the router (the test oracle):
    x [T, H], weights/experts [T, k], stacked kernels → [T, H] float32."""
    act = ACTIVATIONS[activation]
    xf = x.astype(jnp.float32)
    all_out = jnp.einsum("tei,eih->teh",
                         act(jnp.einsum("th,ehi->tei", xf, w_gate)) *
                         jnp.einsum("th,ehi->tei", xf, w_up), w_down)    # [T, E, H]
    mix = jnp.zeros((x.shape[0], w_gate.shape[0]), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], experts].add(weights)
    return jnp.einsum("te,teh->th", mix, all_out)


def test_grouped_experts_equal_every_expert_on_every_token_however_split():
    rng = np.random.default_rng(1)
    tokens, hidden, inter, experts, top_k = 13, 8, 12, 4, 2
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((experts, hidden, inter)) * 0.3, jnp.float32)
                    for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((experts, inter, hidden)) * 0.3, jnp.float32)
    weights, chosen = moe.route(jnp.asarray(rng.standard_normal((tokens, experts))), top_k,
                                True)
    want = dense_moe_reference(x, weights, chosen, w_gate, w_up, w_down)
    whole = moe.grouped_experts(x, weights, chosen, w_gate, w_up, w_down, 0, "silu")
    np.testing.assert_allclose(whole, want, atol=1e-5)
    # Expert parallel: two devices' halves of the experts (pairs routed elsewhere add 0).
    by_experts = sum(moe.grouped_experts(x, weights, chosen, w_gate[e:e + 2], w_up[e:e + 2],
                                         w_down[e:e + 2], e, "silu") for e in (0, 2))
    np.testing.assert_allclose(by_experts, want, atol=1e-5)
    # Tensor parallel: two halves of every expert's intermediate dimension.
    by_columns = sum(moe.grouped_experts(x, weights, chosen, w_gate[:, :, c:c + 6],
                                         w_up[:, :, c:c + 6], w_down[:, c:c + 6], 0, "silu")
                     for c in (0, 6))
    np.testing.assert_allclose(by_columns, want, atol=1e-5)


@pytest.mark.parametrize("sizes, tile", [([0, 9, 0, 20, 3], 8), ([2, 0, 0, 5], 32),
                                         ([37, 0], 16), ([0, 0, 0], 4)])
def test_cpu_grouped_matmul_equals_ragged_dot(sizes, tile):
    # Groups with no rows, rows past the groups (zeros), tiles straddling group edges.
    from jaxserve.models.grouped_matmul import tiled_grouped_matmul

    rng = np.random.default_rng(len(sizes) + tile)
    lhs = jnp.asarray(rng.standard_normal((37, 6)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), 6, 5)), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(tiled_grouped_matmul, static_argnums=3)(lhs, rhs, group_sizes, tile)
    np.testing.assert_allclose(got, jax.lax.ragged_dot(lhs, rhs, group_sizes), atol=1e-5)


# -- whole models against HF ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe_model(request, make_tiny_model):
    config_class, overrides = CONFIGS[request.param]
    model_dir = make_tiny_model(config_class, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    llm = LLM(str(model_dir), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8,
              kv_cache_memory_bytes=2 << 20, **precision.EXACT)
    return request.param, hf, llm


@pytest.mark.engine
def test_moe_logits_and_greedy_tokens_match_hf(moe_model):
    name, hf, llm = moe_model
    arch = llm.llm_engine.engine_core.setup.arch
    assert (arch.options.moe.num_experts, arch.options.moe.top_k) == (4, 2)
    tok = llm.get_tokenizer()
    worst = _check_parity(llm, hf, [tok.encode(t) for t in TEXTS], logits_tol=1e-4)
    logger.warning("%s: max |logits - HF| = %.2e", name, worst)


def test_moe_serving_compiles_nothing_after_warmup(moe_model):
    _, _, llm = moe_model
    from tests.test_parallel import _generate_counting_compiles

    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 300, size=int(n)).tolist() for n in rng.integers(2, 40, 6)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(1, 12, len(prompts))]
    outs, compiles = _generate_counting_compiles(llm, prompts, params)
    assert compiles == []
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


def test_checkpoint_missing_an_expert_names_the_layer_and_expert(make_tiny_model, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxserve.loader import load_model

    model_dir = tmp_path / "model"
    shutil.copytree(make_tiny_model(*CONFIGS["mixtral"][:1], **CONFIGS["mixtral"][1]),
                    model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts_down_proj.kernel \(\(layer, expert\) "
                                         r"\[\(1, 3\)\]\)"):
        load_model(str(model_dir))


@pytest.mark.parametrize("field, value", [("mlp_only_layers", [1]),
                                          ("decoder_sparse_step", 2)])
def test_qwen3_moe_with_dense_layers_is_rejected_naming_the_field(field, value):
    from jaxserve.models.registry import read_arch

    config = transformers.Qwen3MoeConfig(num_hidden_layers=2, **{field: value})
    config.architectures = ["Qwen3MoeForCausalLM"]
    with pytest.raises(ValueError, match=f"{field}={re.escape(str(value))}"):
        read_arch(config)


def write_qwen3_moe_gguf(model_dir: Path, path: Path) -> None:
    """A float32 GGUF of a tiny Qwen3-MoE as llama.cpp's converter writes it: its tensor
    names, each layer's experts stacked [E, out, in], the expert counts in the metadata."""
    import gguf
    from safetensors.numpy import load_file

    from jaxserve.models.qwen3_moe import FAMILY

    c = transformers.AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    tensors = load_file(model_dir / "model.safetensors")
    writer.add_tensor("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", tensors.pop("model.norm.weight"))
    tensors.pop("lm_head.weight", None)     # tied
    hf_to_gguf = {hf: g for hf, g in FAMILY.layer_tensors.values()}
    for layer in range(c.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf, g in hf_to_gguf.items():
            if "{expert}" in hf:
                stacked = np.stack([tensors.pop(prefix + hf.format(expert=e))
                                    for e in range(c.num_experts)])
                writer.add_tensor(f"blk.{layer}.{g}", stacked)
            elif prefix + hf in tensors:
                writer.add_tensor(f"blk.{layer}.{g}", tensors.pop(prefix + hf))
    assert not tensors, sorted(tensors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen3_moe_gguf_written_like_llama_cpp_loads_like_the_safetensors(make_tiny_model,
                                                                          tmp_path):
    from jaxserve.loader import load_model
    from jaxserve.models.registry import read_arch

    model_dir = make_tiny_model(QWEN3_MOE[0], **QWEN3_MOE[1])
    path = tmp_path / "qwen3moe.gguf"
    write_qwen3_moe_gguf(model_dir, path)
    from_gguf = load_model(str(path), tokenizer=str(model_dir))
    from_safetensors = load_model(str(model_dir))
    assert from_gguf.architecture == "Qwen3MoeForCausalLM"
    assert sorted(from_gguf.weights) == sorted(from_safetensors.weights)
    for name, value in from_safetensors.weights.items():
        np.testing.assert_array_equal(from_gguf.weights[name], value, err_msg=name)
    ours, theirs = read_arch(from_gguf.hf_config), read_arch(from_safetensors.hf_config)
    assert ours.options.moe == theirs.options.moe
    assert (ours.intermediate_size, ours.head_dim) == (theirs.intermediate_size, theirs.head_dim)


def write_mixtral_gguf(model_dir: Path, path: Path, merged_experts: bool,
                       expert_type: str | None = None) -> dict[str, np.ndarray]:
    """A float32 GGUF of a tiny Mixtral as llama.cpp's converter writes it (its LlamaModel):
    architecture "llama" plus expert counts, q/k rows permuted, and the experts either
    stacked per layer ``ffn_gate_exps`` [E, out, in] (current llama.cpp) or one tensor per
    expert ``ffn_gate.E`` (older files). Names spelled out here, not read from our tables.

    expert_type ("Q8_0", "Q4_0", "Q4_1", "Q4_K"): the expert tensors stored in that
    llama.cpp block format (the rest float32); returns the checkpoint's expert weights as
    the file's blocks dequantize (gguf.quants), by their Hugging Face names."""
    import gguf
    from safetensors.numpy import load_file

    from tests.test_loader import llama_cpp_permute

    c = transformers.AutoConfig.from_pretrained(model_dir)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    tensors = load_file(model_dir / "model.safetensors")
    dequantized: dict[str, np.ndarray] = {}
    writer.add_tensor("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", tensors.pop("model.norm.weight"))
    writer.add_tensor("output.weight", tensors.pop("lm_head.weight"))
    plain = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
             "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
             "block_sparse_moe.gate.weight": "ffn_gate_inp"}
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for layer in range(c.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for hf, g in plain.items():
            value = tensors.pop(prefix + hf)
            if g in heads:
                value = llama_cpp_permute(value, heads[g])
            writer.add_tensor(f"blk.{layer}.{g}.weight", value)
        for w, g in (("w1", "ffn_gate"), ("w3", "ffn_up"), ("w2", "ffn_down")):
            names = [f"{prefix}block_sparse_moe.experts.{e}.{w}.weight"
                     for e in range(c.num_local_experts)]
            experts = [tensors.pop(n) for n in names]
            if expert_type is not None:
                blocks = quantize_blocks(np.stack(experts), expert_type)
                qtype = gguf.GGMLQuantizationType[expert_type]
                dequantized.update(zip(names, gguf.quants.dequantize(blocks, qtype)))
                experts = list(blocks)
            kw = {} if expert_type is None else {"raw_dtype": qtype}
            if merged_experts:
                writer.add_tensor(f"blk.{layer}.{g}_exps.weight", np.stack(experts), **kw)
            else:
                for e, value in enumerate(experts):
                    writer.add_tensor(f"blk.{layer}.{g}.{e}.weight", value, **kw)
    assert not tensors, sorted(tensors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def quantize_blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    """w [..., n] float32 -> llama.cpp's blocks of `fmt` [..., bytes] (uint8). gguf-py
    quantizes Q8_0 / Q4_0 / Q4_1; it only reads Q4_K, so Q4_K blocks are made here: random
    6-bit sub-block scales and mins and 4-bit values under fp16 super-block d / dmin sized
    to w's spread (the test compares against what the blocks dequantize to, not w)."""
    import gguf

    if fmt != "Q4_K":
        return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[fmt])
    assert w.shape[-1] % 256 == 0, "Q4_K blocks hold 256 values"
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (*w.shape[:-1], w.shape[-1] // 256, 144), dtype=np.uint8)
    spread = float(np.abs(w).mean())
    d = (spread / (15 * 32) * rng.uniform(0.5, 1.5, blocks.shape[:-1])).astype(np.float16)
    dmin = (spread / 32 * rng.uniform(0.5, 1.5, blocks.shape[:-1])).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:4] = dmin[..., None].view(np.uint8)
    return blocks.reshape(*w.shape[:-1], -1)


def test_llama_gguf_with_experts_is_mixtral_and_without_is_llama():
    from jaxserve.models.registry import gguf_family

    def metadata(experts):
        return lambda key, default=None: {"expert_count": experts}.get(key, default)

    assert gguf_family("llama", "x.gguf", metadata(8)).name == "mixtral"
    assert gguf_family("llama", "x.gguf", metadata(0)).name == "llama"
    assert gguf_family("llama", "x.gguf").name == "llama"
    assert gguf_family("qwen3moe", "x.gguf", metadata(128)).name == "qwen3_moe"


@pytest.fixture(scope="module")
def mixtral_gguf(make_tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    model_dir = make_tiny_model(MIXTRAL[0], **MIXTRAL[1])
    path = tmp_path_factory.mktemp("mixtral_gguf") / "mixtral.gguf"
    write_mixtral_gguf(model_dir, path, merged_experts=True)
    return model_dir, path


def test_mixtral_gguf_logits_and_greedy_tokens_match_hf(mixtral_gguf):
    # A "llama" GGUF with expert_count is Mixtral's: routed there, q/k un-permuted.
    model_dir, path = mixtral_gguf
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    llm = LLM(str(path), tokenizer=str(model_dir), max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=8, kv_cache_memory_bytes=2 << 20, **precision.EXACT)
    arch = llm.llm_engine.engine_core.setup.arch
    assert arch.architecture == "MixtralForCausalLM"
    assert (arch.options.moe.num_experts, arch.options.moe.top_k) == (4, 2)
    assert arch.options.moe.renormalize and arch.intermediate_size == 64
    assert arch.options.rope.theta == hf.config.rope_parameters["rope_theta"]
    tok = llm.get_tokenizer()
    worst = _check_parity(llm, hf, [tok.encode(t) for t in TEXTS], logits_tol=1e-4)
    logger.warning("mixtral from GGUF: max |logits - HF| = %.2e", worst)


def test_mixtral_gguf_with_one_tensor_per_expert_loads_like_the_safetensors(mixtral_gguf,
                                                                           tmp_path):
    from jaxserve.loader import load_model

    model_dir, merged_path = mixtral_gguf
    path = tmp_path / "mixtral-per-expert.gguf"
    write_mixtral_gguf(model_dir, path, merged_experts=False)
    from_safetensors = load_model(str(model_dir))
    for gguf_path in (path, merged_path):
        loaded = load_model(str(gguf_path), tokenizer=str(model_dir))
        assert loaded.architecture == "MixtralForCausalLM"
        assert sorted(loaded.weights) == sorted(from_safetensors.weights)
        for name, value in from_safetensors.weights.items():
            np.testing.assert_array_equal(loaded.weights[name], value, err_msg=name)


@pytest.mark.parametrize("quantization", [None, "gguf"])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_mixtral_gguf_with_quantized_experts_matches_hf_on_the_dequantized_weights(
        make_tiny_model, tmp_path, fmt, quantization):
    """Expert tensors ffn_{gate,up,down}_exps [E, out, in] in llama.cpp's block formats:
    dequantized (default) or with quantization="gguf" (packed where the dense path packs),
    the logits and greedy tokens are HF's on a checkpoint holding what the blocks
    dequantize to."""
    import shutil

    from safetensors.numpy import load_file, save_file

    overrides = dict(MIXTRAL[1])
    if fmt == "Q4_K":       # 256-value super-blocks: both expert matmul widths must hold them
        overrides.update(hidden_size=256, intermediate_size=256)
    model_dir = make_tiny_model(MIXTRAL[0], **overrides)
    path = tmp_path / f"mixtral-{fmt}.gguf"
    dequantized = write_mixtral_gguf(model_dir, path, merged_experts=True, expert_type=fmt)
    reference = tmp_path / "hf"
    shutil.copytree(model_dir, reference)
    tensors = load_file(reference / "model.safetensors")
    assert set(dequantized) < set(tensors)
    tensors.update({name: np.ascontiguousarray(w, np.float32) for name, w in dequantized.items()})
    save_file(tensors, reference / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype="float32").eval()
    llm = LLM(str(path), tokenizer=str(model_dir), quantization=quantization,
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8,
              kv_cache_memory_bytes=2 << 20, **precision.EXACT)
    assert llm.llm_engine.engine_core.setup.arch.architecture == "MixtralForCausalLM"
    tok = llm.get_tokenizer()
    worst = _check_parity(llm, hf, [tok.encode(t) for t in TEXTS], logits_tol=1e-4)
    logger.warning("mixtral GGUF, %s experts (%s): max |logits - HF| = %.2e", fmt,
                   quantization or "dequantized", worst)


# -- sharded: tp, ep over simulated devices (one subprocess) ------------------------------------
PROMPTS = [[11, 23, 98], [7] + list(range(40, 77)), [301, 5, 44, 9, 120, 77, 6], [250],
           list(range(100, 140)), [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
MAX_TOKENS = 12
# (name, model, tensor_parallel_size, enable_expert_parallel)
RUNS = [("mixtral_tp1", "mixtral", 1, False), ("mixtral_tp2", "mixtral", 2, False),
        ("mixtral_ep2", "mixtral", 2, True), ("mixtral_ep4", "mixtral", 4, True),
        ("qwen3_moe_tp1", "qwen3_moe", 1, False), ("qwen3_moe_ep4", "qwen3_moe", 4, True)]
NUM_DEVICES = 4


def _expert_facts(runner) -> dict:
    """Expert weights' bytes (total, busiest device) and every shape they take (whole,
    one layer, one shard, one layer of a shard)."""
    total, per_device, shapes = 0, {}, set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(runner.params)[0]:
        if "experts_" not in jax.tree_util.keystr(path):
            continue
        total += leaf.nbytes
        shard = leaf.addressable_shards[0].data.shape
        shapes |= {leaf.shape, leaf.shape[1:], shard, shard[1:]}
        for s in leaf.addressable_shards:
            per_device[s.device.id] = per_device.get(s.device.id, 0) + s.data.nbytes
    return {"expert_bytes": total, "expert_bytes_per_device": max(per_device.values()),
            "expert_shapes": sorted(list(s) for s in shapes)}


def _run(model_dir: str, tp: int, ep: bool) -> dict:
    from tests.test_parallel import _collectives, _generate_counting_compiles, _results

    start = time.perf_counter()
    # Two step buckets (T = S = 1, 2): each engine compiles every bucket at start, and six
    # engines' compiles are most of this module's time.
    llm = LLM(model_dir, tensor_parallel_size=tp, enable_expert_parallel=ep,
              max_model_len=128, max_num_batched_tokens=2, max_num_seqs=2,
              kv_cache_memory_bytes=4 << 20, **precision.EXACT)
    built = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=1)
    outputs, compiles = _generate_counting_compiles(llm, PROMPTS, params)
    runner = llm.llm_engine.engine_core.runner
    result = {**_results(outputs), **_expert_facts(runner), "compiles": compiles,
              "build_seconds": built, "hidden_size": llm.llm_engine.engine_core.setup.arch.hidden_size,
              "vocab_size": llm.llm_engine.engine_core.setup.arch.vocab_size}
    if tp > 1:
        result["collectives"] = _collectives(runner)
    return result


def _export_for_cuda(model_dir: str, tp: int, ep: bool) -> dict:
    """The whole EP step (Pallas attention, shard_map'd experts) exported for cuda."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.model_setup import setup_model

    config = EngineConfig.from_kwargs(model=model_dir, tensor_parallel_size=tp,
                                      enable_expert_parallel=ep, load_format="dummy",
                                      max_model_len=128, max_num_batched_tokens=4,
                                      max_num_seqs=4, kv_cache_memory_bytes=4 << 20)
    from jaxserve.platforms import platform_named

    runner = setup_model(config, target_platform=platform_named("cuda")).runner
    t, s = runner.buckets.all_shapes()[-1]
    exported = runner.export_step(t, s, "cuda")
    mlir = exported.mlir_module()
    return {"nr_devices": exported.nr_devices, "ragged_dot": "ragged_dot" in mlir,
            "triton_calls": mlir.count("__gpu$xla.gpu.triton")}


def worker(spec: dict) -> None:
    import traceback

    results: dict = {}

    def section(name, fn, *args):
        start = time.perf_counter()
        try:
            results[name] = fn(*args)
        except Exception:   # noqa: BLE001 - reported to the test that needs it
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        Path(spec["out"]).write_text(json.dumps(results))

    for name, model, tp, ep in RUNS:
        section(name, _run, spec["models"][model], tp, ep)
    section("export_cuda_ep2", _export_for_cuda, spec["models"]["mixtral"], 2, True)


@pytest.fixture(scope="module")
def sharded(make_tiny_model, tmp_path_factory) -> dict:
    models = {name: str(make_tiny_model(cls, **kw)) for name, (cls, kw) in CONFIGS.items()}
    out = tmp_path_factory.mktemp("moe_parallel") / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={NUM_DEVICES}",
            # this checkout's jaxserve, whatever the environment's editable install points at
            "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, json.dumps({"models": models,
                                                                 "out": str(out)})],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          check=False)
    if not out.exists():
        pytest.fail(f"MoE worker produced nothing (exit {proc.returncode}):\n"
                    f"{proc.stderr[-5000:]}")
    results = json.loads(out.read_text())
    logger.warning("MoE worker sections (s): %s",
                   {k: round(v["seconds"], 1) for k, v in results.items()})
    return results


def _section(results: dict, name: str) -> dict:
    if name not in results:
        pytest.fail(f"the worker never reached {name}")
    if "error" in results[name]:
        pytest.fail(f"{name} failed in the worker:\n{results[name]['error']}")
    return results[name]


@pytest.mark.parametrize("name", [r[0] for r in RUNS if not r[0].endswith("_tp1")])
def test_tensor_and_expert_parallel_greedy_tokens_equal_one_device(sharded, name):
    result = _section(sharded, name)
    reference = _section(sharded, name.rsplit("_", 1)[0] + "_tp1")
    assert result["tokens"] == reference["tokens"]
    assert all(len(t) == MAX_TOKENS for t in result["tokens"])
    for ours, theirs in zip(result["logprobs"], reference["logprobs"]):
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3
    assert result["compiles"] == []


@pytest.mark.parametrize("name, ep", [(r[0], r[2]) for r in RUNS if r[3]])
def test_each_device_holds_one_ep_th_of_the_expert_weights(sharded, name, ep):
    result = _section(sharded, name)
    assert result["expert_bytes"] == _section(sharded, name.rsplit("_", 1)[0] + "_tp1")[
        "expert_bytes"]
    assert result["expert_bytes_per_device"] * ep == result["expert_bytes"]


@pytest.mark.parametrize("name", [r[0] for r in RUNS if r[3]])
def test_expert_parallel_step_exchanges_no_expert_weights(sharded, name):
    result = _section(sharded, name)
    facts = result["collectives"]
    t, s = facts["bucket"]
    hidden, vocab = result["hidden_size"], result["vocab_size"]
    ops = facts["ops"]
    expert_shapes = {tuple(shape) for shape in result["expert_shapes"]}
    for op in ops:
        for shape in op["shapes"]:
            assert tuple(shape) not in expert_shapes, f"expert weights moved: {op}"
    gathers = [op for op in ops if op["op"] == "all-gather"]
    # Only the logits (sampling rows, prompt-logprobs positions) are gathered.
    assert all(shape in ([s, vocab], [facts["prompt_logprobs_slots"], vocab])
               for op in gathers for shape in op["shapes"]), gathers
    # Per layer: o_proj's all-reduce and the experts' combine, both [T, H] partial sums.
    layer_reduces = [op for op in ops if op["op"] == "all-reduce" and op["in_layers"]]
    assert [op["shapes"] for op in layer_reduces] == [[[t, hidden]]] * 2, ops
    assert not [op for op in ops if op["op"] in ("all-to-all", "collective-permute")], ops


def test_expert_parallel_step_exports_for_cuda(sharded):
    result = _section(sharded, "export_cuda_ep2")
    assert result["nr_devices"] == 2
    assert result["ragged_dot"], "the experts should reach XLA as ragged_dot (grouped GEMMs)"
    assert result["triton_calls"] >= 1


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))

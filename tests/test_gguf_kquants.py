"""GGUF files in llama.cpp's K-quant formats (Q4_K / Q5_K / Q6_K: what Q4_K_M / Q5_K_M /
Q6_K downloads hold) load dequantized, by gguf-py's numpy reference, equal to what their
blocks dequantize to; with quantization="gguf" Q4_K / Q5_K / Q6_K stay packed
(with Q8_0 / Q4_0 / Q4_1), read by the block kernels, and the model serves.

gguf-py (0.19) reads the K-quants but cannot write them (its quantize raises
NotImplementedError for them), so the blocks are made here: random quants and sub-block
scales under float16 super-block scales sized to the float weights' spread."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_loader import write_gguf

# bytes per 256-weight super-block, and where its float16 scales sit (d, dmin)
K_QUANTS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208, None))}
# a Q4_K_M-like mix (llama.cpp's Q4_K_M keeps some tensors Q6_K and small ones Q8_0)
TYPES = {"attn_output": "Q4_K", "ffn_gate": "Q5_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K",
         "attn_v": "Q8_0", "token_embd": "Q6_K"}


def k_quant_blocks(w: np.ndarray, fmt: str, rng: np.random.Generator) -> np.ndarray:
    """Random `fmt` blocks uint8 [rows, n / 256 * bytes] for a float [rows, n] weight."""
    nbytes, (d_at, dmin_at) = K_QUANTS[fmt]
    lead = (w.shape[0], w.shape[1] // 256)
    blocks = rng.integers(0, 256, (*lead, nbytes), dtype=np.uint8)
    spread = float(np.abs(w).mean())
    # Q4_K / Q5_K: d * 6-bit scale * q - dmin * 6-bit min; Q6_K: d * int8 scale * (q - 32)
    step = spread / (15 * 32) if fmt != "Q6_K" else spread / (64 * 32)
    blocks[..., d_at:d_at + 2] = (step * rng.uniform(0.5, 1.5, lead)).astype(
        np.float16)[..., None].view(np.uint8)
    if dmin_at is not None:
        blocks[..., dmin_at:dmin_at + 2] = (spread / 32 * rng.uniform(0.5, 1.5, lead)).astype(
            np.float16)[..., None].view(np.uint8)
    return blocks.reshape(w.shape[0], -1)


@pytest.fixture(scope="module")
def k_quant_gguf(make_tiny_model, tmp_path_factory):
    """(model dir, GGUF path, GGUF name -> what its blocks dequantize to) for a tiny Llama
    whose rows hold whole 256-weight super-blocks."""
    import gguf

    model_dir = make_tiny_model("llama", hidden_size=256, intermediate_size=256,
                                tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf"
    rng = np.random.default_rng(0)
    dequantized: dict[str, np.ndarray] = {}

    def encode(name: str, value: np.ndarray):
        fmt = TYPES.get(name.split(".")[-2])
        if fmt is None or value.ndim != 2:
            return value, {}
        qtype = gguf.GGMLQuantizationType[fmt]
        blocks = gguf.quants.quantize(value, qtype) if fmt == "Q8_0" else \
            k_quant_blocks(value, fmt, rng)
        dequantized[name] = gguf.quants.dequantize(blocks, qtype)
        return blocks, {"raw_dtype": qtype}

    write_gguf(model_dir, path, "llama", encode=encode)
    assert {n.split(".")[-2] for n in dequantized} == set(TYPES)
    return model_dir, path, dequantized


def _ours(name: str) -> tuple[str, int | None]:
    """Our stacked weight name and layer of a GGUF projection / embedding name."""
    if name == "token_embd.weight":
        return "embed_tokens", None
    _, layer, kind, _ = name.split(".")
    module = {"attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
              "ffn_down": "down_proj", "attn_v": "v_proj"}[kind]
    return f"layers.{module}.kernel", int(layer)


def test_k_quant_gguf_loads_what_its_blocks_dequantize_to(k_quant_gguf):
    from jaxserve.loader import load_model

    model_dir, path, dequantized = k_quant_gguf
    loaded = load_model(str(path), tokenizer=str(model_dir))
    assert loaded.architecture == "LlamaForCausalLM"
    for name, want in dequantized.items():
        ours, layer = _ours(name)
        got = loaded.weights[ours] if layer is None else loaded.weights[ours][layer].T
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert np.isfinite(want).all() and np.abs(want).max() > 0


def test_k_quant_gguf_serves_with_and_without_packed_blocks(k_quant_gguf):
    """quantization="gguf" keeps the Q8_0 and K-quant tensors packed (read by the block
    kernels, the Q6_K embedding too); greedy tokens agree with the fully dequantized
    model."""
    import jax.numpy as jnp

    from jaxserve import LLM, SamplingParams
    from jaxserve.kernels.cpu.matmul import GGUF_TARGET

    model_dir, path, _ = k_quant_gguf
    kwargs = dict(tokenizer=str(model_dir), max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20)
    prompts = [[11, 23, 98, 421, 77], [300, 301, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for quantization in ("none", "gguf"):
        llm = LLM(str(path), quantization=quantization, dtype="float32", **kwargs)
        layers = llm.llm_engine.engine_core.setup.runner.params["params"]["layers"]
        if quantization == "gguf":
            assert layers["v_proj"]["q8_0"].dtype == jnp.uint8
            assert layers["o_proj"]["q4_k"].dtype == jnp.uint8
            assert layers["gate_proj"]["q5_k"].dtype == jnp.uint8
            assert layers["down_proj"]["q6_k"].dtype == jnp.uint8
            assert llm.llm_engine.engine_core.setup.runner.params["params"]["embed_tokens"]["q6_k"].dtype \
                == jnp.uint8
        tokens[quantization] = [o.outputs[0].token_ids
                                for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.llm_engine.engine_core.runner
        runner.wait_until_compiled()
        decode = runner._steps[min(runner._steps)].as_text()
        assert (GGUF_TARGET in decode) == (quantization == "gguf")   # the block kernel
    assert [t[0] for t in tokens["gguf"]] == [t[0] for t in tokens["none"]]


def test_packed_tensors_keep_a_float_copy_within_the_budget(k_quant_gguf):
    """gguf_float_copy_budget (a GGUF packed by default, engine/gguf_packing.py): every packed
    tensor also dequantized, equal to what the blocks dequantize to, when the copy fits the
    budget; the blocks alone when it does not."""
    from jaxserve.loader import load_model

    model_dir, path, dequantized = k_quant_gguf
    both = load_model(str(path), tokenizer=str(model_dir), quantization="gguf",
                      gguf_float_copy_budget=1 << 30).weights
    for name, want in dequantized.items():
        ours, layer = _ours(name)
        fmt = TYPES[name.split(".")[-2]].lower()
        assert f"{ours.removesuffix('.kernel')}.{fmt}" in both, name
        got = both[ours] if layer is None else both[ours][layer].T
        np.testing.assert_array_equal(got, want, err_msg=name)
    packed_formats = ("q8_0", "q4_k", "q5_k", "q6_k")
    copies = [k for k in both if not k.endswith(packed_formats) and any(
        f"{k.removesuffix('.kernel')}.{f}" in both for f in packed_formats)]
    assert "embed_tokens" in copies and "layers.o_proj.kernel" in copies
    copy_bytes = sum(both[k].nbytes for k in copies)
    alone = load_model(str(path), tokenizer=str(model_dir), quantization="gguf",
                       gguf_float_copy_budget=copy_bytes - 1).weights
    assert not set(copies) & set(alone) and set(alone) == set(both) - set(copies)


def test_a_default_packed_gguf_reads_its_float_copy_fused(k_quant_gguf, monkeypatch):
    """A GGUF packed by default keeps its float copy for steps of many rows; q|k|v and
    gate|up are stored side by side (models/sibling_fusion.py) and read in one matmul per
    group where every member is packed: the blocks per member stay, each member's own copy
    goes, and the engine's prompt
    logits (a 14-token step: the copy's rows) and greedy tokens are those of the copy kept
    per member."""
    import jax.numpy as jnp

    from jaxserve import LLM, SamplingParams
    from jaxserve.kernels.cpu.matmul import GGUF_TARGET, onednn_native_bf16
    from jaxserve.models import sibling_fusion

    model_dir, path, _ = k_quant_gguf
    # bf16 units (emulated by oneDNN where this CPU lacks them): where the fusion pays
    kwargs = dict(tokenizer=str(model_dir), dtype="bfloat16", max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20,
                  matrix_units="avx512")
    prompt = [11, 23, 98, 421, 77, 5, 300, 301, 7, 8, 99, 100, 12, 13]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(sibling_fusion, "fuse_packed_float_copies", lambda p: [])
        llm = LLM(str(path), **kwargs)
        layers = llm.llm_engine.engine_core.setup.runner.params["params"]["layers"]
        # the float copy: plain, or packed for oneDNN where this CPU computes bf16 natively
        # (engine/weight_packing.py)
        copy = "packed_kernel" if onednn_native_bf16() else "kernel"
        # this file packs gate, up and v but not q and k: gate|up fuse, q|k|v do not
        assert ("gate_up_proj" in layers) == fused and "qkv_proj" not in layers
        assert (copy in layers["gate_proj"]) != fused
        assert layers["gate_proj"]["q5_k"].dtype == jnp.uint8
        assert copy in layers["v_proj"] and copy in layers["down_proj"]
        assert not any("kernel" in leaves for leaves in layers.values()) or copy == "kernel"
        if fused and copy == "kernel":
            assert layers["gate_up_proj"]["kernel"].shape[1:] == (256, 2 * 256)
        # the tied table's float copy: plain, or packed for the LM head alone
        embed = llm.llm_engine.engine_core.setup.runner.params["params"]["embed_tokens"]
        assert set(embed) & {"embedding", "packed_head"} == \
            {"packed_head" if copy == "packed_kernel" else "embedding"}
        results[fused] = (np.asarray(llm.llm_engine.prompt_logits(prompt)),
                          [o.outputs[0].token_ids for o in llm.generate(
                              [prompt, prompt[:9]], params, use_tqdm=False)])
        runner = llm.llm_engine.engine_core.runner
        runner.wait_until_compiled()
        # the widest step reads float copies only (the blocks at most in the tied LM head)
        assert runner._steps[max(runner._steps)].as_text().count(GGUF_TARGET) <= 1
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=2e-2, atol=2e-2)
    assert np.mean(results[True][0].argmax(-1) == results[False][0].argmax(-1)) >= 0.9
    assert results[True][1] == results[False][1]


def test_the_float_copies_packed_for_onednn_give_the_plain_copies_logits(k_quant_gguf,
                                                                          monkeypatch):
    """Where this CPU computes bf16 natively the float copy of every projection and of the
    tied table are packed at startup (engine/weight_packing.py): the prompt logits of a
    14-token step (the copies' rows: projections and LM head) and greedy tokens are those of
    the same copies kept plain."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.engine import weight_packing
    from jaxserve.kernels.cpu.matmul import onednn_native_bf16

    if not onednn_native_bf16():
        pytest.skip("oneDNN has no bf16 kernel on this CPU: nothing is packed")
    model_dir, path, _ = k_quant_gguf
    prompt = [11, 23, 98, 421, 77, 5, 300, 301, 7, 8, 99, 100, 12, 13]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(weight_packing, "why_not_packed", lambda *args: "test: off")
        llm = LLM(str(path), tokenizer=str(model_dir), dtype="bfloat16", max_model_len=64,
                  max_num_seqs=2, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20,
                  matrix_units="avx512")
        tree = llm.llm_engine.engine_core.setup.runner.params["params"]
        assert ("packed_head" in tree["embed_tokens"]) == packed
        assert ("packed_kernel" in tree["layers"]["down_proj"]) == packed
        results[packed] = (np.asarray(llm.llm_engine.prompt_logits(prompt)),
                           [o.outputs[0].token_ids for o in llm.generate(
                               [prompt, prompt[:9]], params, use_tqdm=False)])
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=2e-2, atol=2e-2)
    assert np.mean(results[True][0].argmax(-1) == results[False][0].argmax(-1)) >= 0.9
    assert results[True][1] == results[False][1]


def test_without_bf16_units_each_projection_keeps_its_float_copy(k_quant_gguf):
    """--matrix-units none (an AVX2 CPU's path): the fused calls measured no faster there
    (slower in float32), so the float copy stays one per projection."""
    from jaxserve import LLM

    model_dir, path, _ = k_quant_gguf
    llm = LLM(str(path), tokenizer=str(model_dir), dtype="bfloat16", max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20,
              matrix_units="none")
    layers = llm.llm_engine.engine_core.setup.runner.params["params"]["layers"]
    assert "gate_up_proj" not in layers and "kernel" in layers["gate_proj"] \
        and "q5_k" in layers["gate_proj"]


@pytest.mark.fast
def test_the_fusion_pays_for_bf16_copies_on_bf16_units_only():
    import jax.numpy as jnp

    from jaxserve.models.sibling_fusion import fusion_pays

    assert fusion_pays(jnp.bfloat16, True)
    assert not fusion_pays(jnp.bfloat16, False) and not fusion_pays(jnp.float32, True)


@pytest.mark.fast
def test_sibling_float_copies_fuse_only_where_every_member_is_packed_with_a_copy():
    from jaxserve.models.sibling_fusion import fuse_packed_float_copies

    rng = np.random.default_rng(1)

    def member(out, packed=True, dtype=np.float32):
        leaf = {"kernel": rng.standard_normal((2, 8, out)).astype(dtype)}
        if packed:
            leaf["q8_0"] = np.zeros((2, out, 34), np.uint8)
        return leaf

    layers = {"q_proj": member(8), "k_proj": member(4), "v_proj": member(4),
              "gate_proj": member(6), "up_proj": member(6, packed=False),
              "o_proj": member(8)}
    kernels = {name: leaf["kernel"] for name, leaf in layers.items()}
    assert fuse_packed_float_copies({"params": {"layers": layers}}) == ["qkv_proj"]
    np.testing.assert_array_equal(layers["qkv_proj"]["kernel"], np.concatenate(
        [kernels["q_proj"], kernels["k_proj"], kernels["v_proj"]], axis=2))
    assert all("kernel" not in layers[n] and "q8_0" in layers[n]
               for n in ("q_proj", "k_proj", "v_proj"))
    # gate|up: up holds no blocks (a plain float projection), so neither is fused
    assert "gate_up_proj" not in layers and "kernel" in layers["gate_proj"]
    assert "kernel" in layers["o_proj"]
    mixed = {"gate_proj": member(6), "up_proj": member(6, dtype=np.float16)}
    assert fuse_packed_float_copies({"params": {"layers": mixed}}) == []

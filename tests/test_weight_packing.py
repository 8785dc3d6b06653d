"""Projection weights packed at startup into oneDNN's blocked layout
(kernels/cpu/packed_matmul.py, onednn_packed.cc, engine/weight_packing.py): the packed call
against float64 numpy on random inputs, the rule that keeps weights plain where packing buys
nothing, and a served model's logits and tokens with packed weights against the same model
with plain ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _library_or_skip():
    from jaxserve.kernels.cpu.matmul import available

    if not available():
        pytest.skip("the CPU matmul library does not build here (no C++ compiler / oneDNN)")


def _packs_or_skip(dtype, n_in=64, n_out=64):
    from jaxserve.kernels.cpu.packed_matmul import packed_bytes

    _library_or_skip()
    if packed_bytes(n_in, n_out, dtype) == 0:
        pytest.skip(f"oneDNN reads {jnp.dtype(dtype).name} weights plain on this CPU "
                    "(nothing is packed here)")


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_the_packed_matmul_matches_float64_at_every_row_count_and_layer(dtype):
    from jaxserve.kernels.cpu.packed_matmul import pack_stacked, packed_layer_matmul

    _packs_or_skip(dtype)
    rng = np.random.default_rng(3)
    # widths off the 64-column blocks, a width under one block, inputs off 16 / 32
    for n_in, n_out in ((100, 70), (96, 320), (200, 40)):
        w = rng.standard_normal((3, n_in, n_out)).astype(np.float32).astype(dtype)
        packed = pack_stacked(np.asarray(w))
        assert packed is not None and packed.dtype == np.uint8 and packed.shape[0] == 3
        for rows in (1, 5, 64, 530):
            x = rng.standard_normal((rows, n_in)).astype(np.float32).astype(dtype)
            for layer in (0, 2):
                y = jax.jit(packed_layer_matmul, static_argnums=(3, 4))(
                    x, packed, layer, n_out, dtype)
                want = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
                assert y.dtype == jnp.float32 and y.shape == (rows, n_out)
                # bf16 products are exact in float32: only the sums' order and rounding differ
                np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5,
                                           atol=1e-5 * np.abs(want).max())


@pytest.mark.fast
def test_a_table_packed_transposed_gives_the_tied_heads_logits():
    from jaxserve.kernels.cpu.packed_matmul import pack_stacked, packed_layer_matmul

    _packs_or_skip(jnp.bfloat16)
    rng = np.random.default_rng(4)
    table = rng.standard_normal((1, 300, 96)).astype(jnp.bfloat16)     # [1, V, H]
    packed = pack_stacked(table, transposed=True)
    x = rng.standard_normal((20, 96)).astype(jnp.bfloat16)
    y = packed_layer_matmul(x, packed, 0, 300, jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(table[0], np.float64).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.fast
def test_packed_weights_of_another_shape_or_part_count_are_refused_with_a_clear_error():
    from jaxserve.kernels.cpu.packed_matmul import pack_stacked, packed_layer_matmul

    _packs_or_skip(jnp.bfloat16)
    w = np.random.default_rng(0).standard_normal((2, 64, 128)).astype(jnp.bfloat16)
    packed = pack_stacked(w)
    x = jnp.ones((4, 64), jnp.bfloat16)
    with pytest.raises(Exception, match="packed on another CPU or for another shape"):
        jax.block_until_ready(packed_layer_matmul(x, packed, 0, 192, jnp.bfloat16))
    # the same bytes cut into other column ranges (another CPU count): named, never misread
    from jaxserve.kernels.cpu.packed_matmul import packing_parts

    other = pack_stacked(w, parts=2 * packing_parts())
    assert other.shape == packed.shape      # 128 columns: the byte counts agree
    with pytest.raises(Exception, match=f"in {2 * packing_parts()} parts, read as"):
        jax.block_until_ready(packed_layer_matmul(x, other, 0, 128, jnp.bfloat16))
    with pytest.raises(Exception, match="holds no packed weights"):
        jax.block_until_ready(packed_layer_matmul(x, np.zeros_like(packed), 0, 128,
                                                  jnp.bfloat16))


@pytest.mark.fast
def test_an_avx2_cpu_keeps_weights_plain():
    """oneDNN capped to AVX2 (an AVX2-only CPU's path) has no blocked kernel for either
    dtype: packed_bytes says 0 and nothing is packed."""
    _library_or_skip()
    code = ("import numpy as np, jax.numpy as jnp\n"
            "from jaxserve.kernels.cpu.packed_matmul import pack_stacked, packed_bytes\n"
            "print(packed_bytes(576, 1536, jnp.bfloat16), packed_bytes(576, 1536, jnp.float32),"
            " pack_stacked(np.ones((1, 64, 64), jnp.bfloat16)))\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "0", "None"]


@pytest.mark.fast
def test_the_rule_packs_bf16_on_bf16_units_reading_in_place_only():
    from jaxserve.engine.weight_packing import why_not_packed

    _library_or_skip()
    assert "float32" in why_not_packed(jnp.float32, True, True, False)
    assert "matrix units" in why_not_packed(jnp.bfloat16, False, True, False)
    assert "in place" in why_not_packed(jnp.bfloat16, True, False, False)
    assert "aot" in why_not_packed(jnp.bfloat16, True, True, True)


@pytest.mark.fast
def test_packing_a_tree_replaces_only_stacked_projection_kernels_and_its_spec_agrees():
    from jaxserve.engine.weight_packing import (
        PackedOnArrival,
        pack_layer_weights,
        packed_spec,
    )

    _packs_or_skip(jnp.bfloat16)
    rng = np.random.default_rng(5)

    def bf16(*shape):
        return jax.device_put(rng.standard_normal(shape).astype(jnp.bfloat16))

    def tree(gguf_table=False):
        table = {"embedding": bf16(32, 64)}
        if gguf_table:       # GGUF blocks with their float copy: the copy serves the head
            table["q8_0"] = jax.device_put(np.zeros((32, 68), np.uint8))
        return {"params": {"embed_tokens": table,
                           "layers": {"q_proj": {"kernel": bf16(2, 64, 64), "bias": bf16(2, 64)},
                                      "gate_up_proj": {"kernel": bf16(2, 64, 256)},
                                      "router": {"kernel": bf16(2, 64, 8)},
                                      "down_proj": {"kernel": jax.device_put(
                                          np.ones((2, 128, 64), np.float32))}}}}

    params = tree()
    spec = packed_spec(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
                       jnp.bfloat16)
    packed, names, _ = pack_layer_weights(params, jnp.bfloat16)
    assert sorted(names) == ["layers.gate_up_proj", "layers.q_proj"]
    assert set(packed["params"]["embed_tokens"]) == {"embedding"}   # lookups read it
    layers = packed["params"]["layers"]
    assert set(layers["q_proj"]) == {"packed_kernel", "bias"}
    assert "kernel" in layers["router"] and "kernel" in layers["down_proj"]   # not a Linear / f32
    assert jax.tree.map(lambda a: (a.shape, a.dtype), packed) == \
        jax.tree.map(lambda s: (s.shape, s.dtype), spec)

    class Restoring:       # engine/model_source.RestoringParams' contract
        def __init__(self, params):
            self.params = params
            self.spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

        def result(self):
            return self.params

    gguf, names, _ = pack_layer_weights(tree(gguf_table=True), jnp.bfloat16)
    assert "embed_tokens" in names
    assert set(gguf["params"]["embed_tokens"]) == {"q8_0", "packed_head"}
    arriving = PackedOnArrival(Restoring(tree(gguf_table=True)), jnp.bfloat16)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), arriving.spec) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), arriving.result())


@pytest.mark.fast
def test_plain_siblings_are_fused_before_packing_and_keep_their_other_leaves():
    from jaxserve.engine.weight_packing import pack_layer_weights, packed_spec
    from jaxserve.kernels.cpu.packed_matmul import packed_layer_matmul

    _packs_or_skip(jnp.bfloat16)
    rng = np.random.default_rng(6)
    host = {name: rng.standard_normal((2, 64, out)).astype(jnp.bfloat16)
            for name, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32),
                              ("gate_proj", 96), ("up_proj", 96))}

    def tree():
        layers = {name: {"kernel": jax.device_put(w)} for name, w in host.items()}
        layers["q_proj"]["bias"] = jax.device_put(np.ones((2, 64), jnp.bfloat16))
        layers["up_proj"]["kernel"] = jax.device_put(host["up_proj"].astype(np.float32))
        return {"params": {"layers": layers}}

    spec = packed_spec(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree()),
                       jnp.bfloat16)
    packed, names, _ = pack_layer_weights(tree(), jnp.bfloat16)
    layers = packed["params"]["layers"]
    # q|k|v fuse (one dtype); gate|up do not (up is float32): gate is packed alone
    assert sorted(names) == ["layers.gate_proj", "layers.qkv_proj"]
    assert set(layers["q_proj"]) == {"bias"} and layers["k_proj"] == {} == layers["v_proj"]
    assert "kernel" in layers["up_proj"] and "gate_up_proj" not in layers
    assert jax.tree.map(lambda a: (a.shape, a.dtype), packed) == \
        jax.tree.map(lambda s: (s.shape, s.dtype), spec)
    x = rng.standard_normal((9, 64)).astype(jnp.bfloat16)
    y = packed_layer_matmul(x, layers["qkv_proj"]["packed_kernel"], 1, 128, jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.concatenate(
        [np.asarray(host[n][1], np.float64) for n in ("q_proj", "k_proj", "v_proj")], axis=1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.fast
def test_what_does_not_fit_twice_in_free_memory_stays_plain_and_unfused(monkeypatch, caplog):
    """Packing holds a target's plain array, its packed host copy and the device copy at
    once: with host memory for only the small targets, the big ones stay plain (and a group
    whose fused packing does not fit keeps its members' own kernels), said in the log."""
    import logging

    from jaxserve.engine import weight_packing

    _packs_or_skip(jnp.bfloat16)
    rng = np.random.default_rng(8)
    layers = {name: {"kernel": jax.device_put(rng.standard_normal((2, 64, out))
                                             .astype(jnp.bfloat16))}
              for name, out in (("q_proj", 64), ("k_proj", 64), ("v_proj", 64),
                                ("gate_proj", 1024), ("up_proj", 1024), ("o_proj", 64))}
    params = {"params": {"layers": layers}}
    # room for twice o_proj's packed bytes and q|k|v's, not gate|up's
    monkeypatch.setattr(weight_packing, "available_host_bytes", lambda: 2 * 2 * 64 * 200 * 2)
    spec = weight_packing.packed_spec(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params), jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        packed, names, _ = weight_packing.pack_layer_weights(params, jnp.bfloat16)
    assert sorted(names) == ["layers.o_proj", "layers.qkv_proj"]
    assert "kept plain" in caplog.text and "layers.gate_up_proj" in caplog.text
    out = packed["params"]["layers"]
    assert "gate_up_proj" not in out and "kernel" in out["gate_proj"] and "kernel" in out["up_proj"]
    assert jax.tree.map(lambda a: (a.shape, a.dtype), packed) == \
        jax.tree.map(lambda s: (s.shape, s.dtype), spec)


def test_a_served_bf16_model_with_packed_weights_gives_the_plain_weights_logits_and_tokens(
        make_tiny_model):
    """The same tiny llama in bfloat16, served with its projections packed (bf16 units: q|k|v
    and gate|up fused too) and plain (--matrix-units none): prompt logits of a short step, of
    one wider than the plan's library rows (packed weights are read in place there too), and
    greedy tokens agree."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.models.execution_plan import MAX_LIBRARY_ROWS

    _packs_or_skip(jnp.bfloat16)
    model = make_tiny_model("llama", num_hidden_layers=2, max_position_embeddings=1024)
    rng = np.random.default_rng(11)
    short = [int(t) for t in rng.integers(3, 200, 14)]
    wide = [int(t) for t in rng.integers(3, 200, MAX_LIBRARY_ROWS + 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = {}
    for units in ("avx512", "none"):
        llm = LLM(str(model), dtype="bfloat16", max_model_len=1024, max_num_seqs=2,
                  max_num_batched_tokens=1024, kv_cache_memory_bytes=8 << 20,
                  matrix_units=units)
        layers = llm.llm_engine.engine_core.setup.runner.params["params"]["layers"]
        packed = units == "avx512"
        # packed: q|k|v and gate|up fused (one call per group), each member's kernel gone
        assert ("qkv_proj" in layers and "gate_up_proj" in layers) == packed
        assert ("kernel" in layers["q_proj"]) != packed
        assert ("packed_kernel" in layers["down_proj"]) == packed
        if packed:
            assert llm.llm_engine.engine_core.runner.plan.packed_weights
        results[units] = (np.asarray(llm.llm_engine.prompt_logits(short)),
                          np.asarray(llm.llm_engine.prompt_logits(wide)),
                          [o.outputs[0].token_ids for o in llm.generate(
                              [short, short[:9]], params, use_tqdm=False)])
    for got, want in zip(results["avx512"][:2], results["none"][:2]):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.95
    assert results["avx512"][2] == results["none"][2]


def test_lora_adapters_on_packed_and_fused_projections_give_the_plain_weights_logits(
        make_tiny_model, tmp_path, monkeypatch):
    """LoRA deltas are added per member after the fused packed product (q|k|v, gate|up):
    a bf16 engine with packed weights gives the logits of the same engine with plain ones,
    for the base model and under an adapter (which must change them)."""
    from jaxserve import LLM
    from jaxserve.engine import weight_packing
    from jaxserve.lora.request import LoRARequest
    from tests.lora_adapters import make_peft_adapter

    _packs_or_skip(jnp.bfloat16)
    model = make_tiny_model("llama", num_hidden_layers=2)
    make_peft_adapter(model, tmp_path / "adapter", rank=8, alpha=16, std=0.2)
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    ids = list(range(3, 17))
    results = {}
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(weight_packing, "why_not_packed", lambda *args: "test: off")
        llm = LLM(str(model), dtype="bfloat16", max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20, enable_lora=True,
                  max_lora_rank=8, matrix_units="avx512")
        layers = llm.llm_engine.engine_core.setup.runner.params["params"]["layers"]
        assert ("qkv_proj" in layers) == packed
        results[packed] = [np.asarray(llm.llm_engine.prompt_logits(ids, r)) for r in (None, lora)]
    assert np.abs(results[True][1] - results[True][0]).max() > 0.1    # the adapter matters
    for got, want in zip(results[True], results[False]):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)

"""AWQ and GPTQ checkpoints (jaxserve/quantization/awq_gptq.py, loader/awq_gptq_loader.py).

The checkpoints are built here: a tiny random Llama's projections quantized group-wise and
packed by the formats' published rules (AutoAWQ's GEMM packing, AutoGPTQ's packing), written
independently of jaxserve's unpacking. The reference is Hugging Face transformers on the
dequantized float weights: the same quantized model, unpacked by the packer's own numbers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.quantization.awq_gptq import (
    checkpoint_method,
    dequantize,
    packed_int_matmul,
    parse_quantization_config,
    repack,
)
from tests import precision

REPO = Path(__file__).resolve().parents[1]
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Big enough that the packed projections dominate the float embedding (resident-bytes check).
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True)
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              kv_cache_memory_bytes=2 << 20, **precision.EXACT)
PROMPTS = ["Hello, world!", "The quick brown fox", "def add(a, b):"]


# -- the formats' packing rules (test-side, from the published layouts) -----------------------
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]    # AutoAWQ: field i of a word holds column order[i]


def quantize_groups(w: np.ndarray, bits: int, g_idx: np.ndarray, groups: int, sym: bool):
    """w [in, out] float32 -> (q [in, out], scales f16 [G, out], zeros [G, out], the
    dequantized float32 weight (q - z) * s); min-max asymmetric, or GPTQ's symmetric
    (zero = 2**(bits-1))."""
    maxq = 2 ** bits - 1
    q = np.zeros(w.shape, np.int64)
    scales = np.zeros((groups, w.shape[1]), np.float16)
    zeros = np.zeros((groups, w.shape[1]), np.int64)
    for g in range(groups):
        rows = g_idx == g
        wg = w[rows]
        if sym:
            s = np.maximum(np.abs(wg).max(0) * 2 / maxq, 1e-8)
            z = np.full(w.shape[1], (maxq + 1) // 2)
        else:
            lo, hi = np.minimum(wg.min(0), 0), np.maximum(wg.max(0), 0)
            s = np.maximum((hi - lo) / maxq, 1e-8)
            z = np.clip(np.round(-lo / s), 1, maxq).astype(np.int64)   # GPTQ's v1 needs z >= 1
        scales[g] = s
        zeros[g] = z
        q[rows] = np.clip(np.round(wg / scales[g].astype(np.float32)) + z, 0, maxq)
    deq = (q - zeros[g_idx]).astype(np.float32) * scales[g_idx].astype(np.float32)
    return q, scales, zeros, deq


def awq_tensors(q, scales, zeros) -> dict[str, np.ndarray]:
    """AutoAWQ WQLinear_GEMM: int4 packed along out, 8 per int32, in AWQ_PACK_ORDER."""
    def pack_columns(values):
        packed = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
        for col in range(values.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= values[:, col * 8 + AWQ_PACK_ORDER[i]].astype(np.uint32) << (4 * i)
        return packed.view(np.int32)
    return {"qweight": pack_columns(q), "qzeros": pack_columns(zeros), "scales": scales}


def gptq_tensors(q, scales, zeros, g_idx, bits) -> dict[str, np.ndarray]:
    """AutoGPTQ QuantLinear.pack: qweight packed along in (row i of 32/bits inputs), qzeros
    along out, both low field first; the "gptq" format stores zeros - 1."""
    per = 32 // bits
    qweight = np.zeros((q.shape[0] // per, q.shape[1]), np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= q[row * per + j].astype(np.uint32) << (bits * j)
    stored = (zeros - 1) & (2 ** bits - 1)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per), np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= stored[:, col * per + j].astype(np.uint32) << (bits * j)
    return {"qweight": qweight.view(np.int32), "qzeros": qzeros.view(np.int32),
            "scales": scales, "g_idx": g_idx.astype(np.int32)}


def group_index(n_in: int, group: int, act_order: bool, rng) -> np.ndarray:
    """i // group, or act-order's: groups formed along a random permutation of the inputs."""
    if not act_order:
        return np.arange(n_in) // group
    g_idx = np.empty(n_in, np.int64)
    g_idx[rng.permutation(n_in)] = np.arange(n_in) // group
    return g_idx


VARIANTS = {
    "awq": dict(method="awq", bits=4, group=128, act_order=False, sym=False,
                config={"quant_method": "awq", "bits": 4, "group_size": 128,
                        "zero_point": True, "version": "gemm"}),
    "gptq-act-order": dict(method="gptq", bits=4, group=64, act_order=True, sym=True,
                           config={"quant_method": "gptq", "bits": 4, "group_size": 64,
                                   "desc_act": True, "sym": True}),
    "gptq-8bit": dict(method="gptq", bits=8, group=128, act_order=False, sym=False,
                      config={"quant_method": "gptq", "bits": 8, "group_size": 128,
                              "desc_act": False, "sym": False, "checkpoint_format": "gptq"}),
}


def write_quantized(float_dir: Path, out: Path, variant: dict) -> Path:
    """A quantized checkpoint of float_dir (out/quantized) and its dequantized float twin
    (out/dequantized), both complete model directories."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(7)
    tensors = load_file(str(float_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        if not any(module.endswith(p) for p in PROJECTIONS):
            quantized[name] = dequantized[name] = value
            continue
        w = value.T.astype(np.float32)                     # [in, out]
        g_idx = group_index(w.shape[0], variant["group"], variant["act_order"], rng)
        q, scales, zeros, deq = quantize_groups(w, variant["bits"], g_idx,
                                                w.shape[0] // variant["group"], variant["sym"])
        parts = (awq_tensors(q, scales, zeros) if variant["method"] == "awq"
                 else gptq_tensors(q, scales, zeros, g_idx, variant["bits"]))
        quantized |= {f"{module}.{k}": np.ascontiguousarray(v) for k, v in parts.items()}
        if variant["method"] == "gptq":   # AutoGPTQ writes zero biases the model does not have
            quantized[f"{module}.bias"] = np.zeros(w.shape[1], np.float16)
        dequantized[name] = np.ascontiguousarray(deq.T)
    for kind, arrays in (("quantized", quantized), ("dequantized", dequantized)):
        shutil.copytree(float_dir, out / kind)
        save_file(arrays, str(out / kind / "model.safetensors"))
    config = json.loads((out / "quantized" / "config.json").read_text())
    config["quantization_config"] = variant["config"]
    (out / "quantized" / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def checkpoints(make_tiny_model, tmp_path_factory):
    float_dir = make_tiny_model("llama", **TINY)
    root = tmp_path_factory.mktemp("awq_gptq")
    return {name: write_quantized(float_dir, root / name, v) for name, v in VARIANTS.items()}


# -- unpacking, unit level --------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_repacked_matmul_equals_the_packers_dequantized_weight(name):
    variant = VARIANTS[name]
    rng = np.random.default_rng(3)
    n_in, n_out = 256, 48
    w = rng.standard_normal((n_in, n_out)).astype(np.float32)
    g_idx = group_index(n_in, variant["group"], variant["act_order"], rng)
    q, scales, zeros, deq = quantize_groups(w, variant["bits"], g_idx, n_in // variant["group"],
                                            variant["sym"])
    parts = (awq_tensors(q, scales, zeros) if variant["method"] == "awq"
             else gptq_tensors(q, scales, zeros, g_idx, variant["bits"]))
    internal = repack(parts, parse_quantization_config(variant["config"]), n_in, n_out, name)
    assert ("g_idx" in internal) == variant["act_order"]   # a trivial g_idx is dropped
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    y = packed_int_matmul(jnp.asarray(x), {k: jnp.asarray(v) for k, v in internal.items()},
                          jnp.float32)
    np.testing.assert_allclose(np.asarray(y), x @ deq, rtol=1e-5, atol=1e-4)


# -- whole checkpoints: the loader, then the engine ------------------------------------------
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_loaded_checkpoint_stays_packed_and_dequantizes_to_the_packers_weights(checkpoints,
                                                                               name):
    from jaxserve.loader import load_model

    variant = VARIANTS[name]
    loaded = load_model(checkpoints[name] / "quantized")
    twin = load_model(checkpoints[name] / "dequantized").weights
    assert loaded.quantization == variant["method"]        # picked from quant_method
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert f"layers.{proj}.kernel" not in loaded.weights
        leaves = {leaf: loaded.weights[f"layers.{proj}.{leaf}"]
                  for leaf in ("qweight", "scales", "zeros", "g_idx")
                  if f"layers.{proj}.{leaf}" in loaded.weights}
        assert leaves["qweight"].dtype == np.int32
        assert ("g_idx" in leaves) == variant["act_order"]
        expected = twin[f"layers.{proj}.kernel"]
        for layer in range(expected.shape[0]):
            w = jax.jit(dequantize, static_argnums=(1, 2))(
                {k: v[layer] for k, v in leaves.items()}, expected.shape[1], jnp.float32)
            np.testing.assert_array_equal(np.asarray(w), expected[layer])
    resident = sum(w.nbytes for w in loaded.weights.values())
    float32 = sum(w.nbytes for w in twin.values())
    assert resident <= (0.35 if variant["bits"] == 4 else 0.5) * float32, resident / float32


@pytest.mark.parametrize("name", ["awq", "gptq-act-order"])
def test_checkpoint_is_served_packed_and_matches_hf_on_the_dequantized_weights(checkpoints,
                                                                               name):
    import transformers

    from tests.hf_reference import hf_greedy, hf_logits

    llm = LLM(str(checkpoints[name] / "quantized"), **ENGINE)    # quant_method picks the mode
    setup = llm.llm_engine.engine_core.setup
    layers = setup.runner.params["params"]["layers"]
    assert "kernel" not in layers["q_proj"] and layers["q_proj"]["qweight"].dtype == jnp.int32
    assert ("g_idx" in layers["down_proj"]) == VARIANTS[name]["act_order"]
    assert setup.weight_bytes <= 0.35 * setup.num_params * 4, \
        f"{setup.weight_bytes} bytes resident for {setup.num_params} parameters"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints[name] / "dequantized", dtype="float32").eval()
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in PROMPTS]
    for prompt in prompts:
        np.testing.assert_allclose(llm.llm_engine.prompt_logits(prompt), hf_logits(hf, prompt),
                                   atol=1e-3, rtol=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 6)


# -- errors ------------------------------------------------------------------------------------
def test_an_explicit_quantization_that_does_not_match_the_checkpoint_is_an_error(checkpoints,
                                                                                make_tiny_model):
    from jaxserve.loader import load_model

    awq = checkpoints["awq"] / "quantized"
    with pytest.raises(ValueError, match="quantization='gptq' does not match .*quant_method='awq'"):
        load_model(awq, quantization="gptq")
    with pytest.raises(ValueError, match="quantization='int8' does not match"):
        load_model(awq, quantization="int8")
    with pytest.raises(ValueError, match="quantization='awq' needs a awq checkpoint"):
        load_model(make_tiny_model("llama", **TINY), quantization="awq")
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model(awq, load_format="dummy")
    assert load_model(awq, quantization="awq").quantization == "awq"


@pytest.mark.parametrize("config, field", [
    ({"quant_method": "gptq", "bits": 3}, "bits=3"),
    ({"quant_method": "gptq", "bits": 2}, "bits=2"),
    ({"quant_method": "awq", "bits": 8}, "bits=8"),
    ({"quant_method": "awq", "version": "gemv"}, "version='gemv'"),
    ({"quant_method": "awq", "version": "GEMV_FAST"}, "version='GEMV_FAST'"),
    ({"quant_method": "awq", "zero_point": False}, "zero_point=False"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "is_marlin_format": True}, "checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "lm_head": True}, "lm_head=True"),
    ({"quant_method": "gptq", "group_size": 0}, "group_size=0"),
    ({"quant_method": "exl2", "bits": 4}, "quant_method='exl2'"),
])
def test_unsupported_variants_are_errors_naming_the_field_and_value(config, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        parse_quantization_config(config)


def test_an_unsupported_quant_method_in_config_json_is_an_error():
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not supported"):
        checkpoint_method({"quant_method": "bitsandbytes"}, None, "model")


# -- tensor parallelism (a subprocess with 2 simulated devices) --------------------------------
def test_tp2_shards_packed_projections_and_matches_the_unsharded_matmul(tmp_path):
    """Column- (q_proj) and row-parallel (down_proj) layers, contiguous groups and act-order,
    sharded by the family's partition specs: the jitted matmul equals x @ W_dequantized."""
    rng = np.random.default_rng(11)
    cases = {}
    for name in ("awq", "gptq-act-order"):
        variant = VARIANTS[name]
        w = rng.standard_normal((256, 128)).astype(np.float32)
        g_idx = group_index(256, variant["group"], variant["act_order"], rng)
        q, scales, zeros, deq = quantize_groups(w, variant["bits"], g_idx,
                                                256 // variant["group"], variant["sym"])
        parts = (awq_tensors(q, scales, zeros) if variant["method"] == "awq"
                 else gptq_tensors(q, scales, zeros, g_idx, variant["bits"]))
        internal = repack(parts, parse_quantization_config(variant["config"]), 256, 128, name)
        x = rng.standard_normal((3, 256)).astype(np.float32)
        cases |= {f"{name}/{k}": v for k, v in internal.items()}
        cases |= {f"{name}/x": x, f"{name}/expected": x @ deq}
    np.savez(tmp_path / "cases.npz", **cases)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__, str(tmp_path / "cases.npz")], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["specs"]["q_proj/qweight"] == [None, None, "model"]     # column: split out
    assert result["specs"]["down_proj/qweight"] == [None, "model", None]  # row: split in words
    assert result["specs"]["down_proj/g_idx"] == [None, "model"]
    assert result["specs"]["down_proj/scales"] == []                      # row: tables whole
    assert set(result["errors"]) == {f"{n}/{m}" for n in ("awq", "gptq-act-order")
                                     for m in ("q_proj", "down_proj")}
    assert max(result["errors"].values()) < 1e-4, result["errors"]


def _tp2_worker(path: str) -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.mesh import MODEL_AXIS, make_mesh
    from jaxserve.models.llama import FAMILY

    cases = dict(np.load(path))
    mesh = make_mesh(2, 1)
    specs, errors = {}, {}
    for name in ("awq", "gptq-act-order"):
        leaves = {k.split("/")[1]: v[None] for k, v in cases.items()    # stacked: L = 1
                  if k.startswith(name) and k.split("/")[1] in ("qweight", "scales", "zeros",
                                                                "g_idx")}
        for module in ("q_proj", "down_proj"):
            params = {}
            for leaf, value in leaves.items():
                spec = FAMILY.param_spec(("layers", module, leaf), value.shape, 2)
                specs[f"{module}/{leaf}"] = list(spec)
                params[leaf] = jax.device_put(value, NamedSharding(mesh, spec))
            x_spec = P(None, MODEL_AXIS) if module == "down_proj" else P()   # row: x split on in
            x = jax.device_put(cases[f"{name}/x"], NamedSharding(mesh, x_spec))
            y = jax.jit(lambda p, x: packed_int_matmul(x, {k: v[0] for k, v in p.items()},
                                                       jnp.float32))(params, x)
            errors[f"{name}/{module}"] = float(np.abs(np.asarray(y)
                                                      - cases[f"{name}/expected"]).max())
    print(json.dumps({"specs": specs, "errors": errors}))


if __name__ == "__main__":
    _tp2_worker(sys.argv[1])

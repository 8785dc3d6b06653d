"""Quantized weights: int8 w8a16 and GGUF blocks kept packed (jaxserve/quantization)."""

from __future__ import annotations

import contextlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.mesh import MODEL_AXIS
from jaxserve.models.layers import Embedding, Linear
from jaxserve.models.llama import FAMILY as LLAMA
from jaxserve.quantization.gguf_packed import BYTES_PER_BLOCK, dequantize
from jaxserve.quantization.int8 import dequantize_int8, group_size_for, quantize_int8


@contextlib.contextmanager
def compile_events():
    """Collect jax's compile / trace events while the block runs (tests/test_engine.py's
    listener pattern)."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            events.append(event)

    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _gguf_pack(w: np.ndarray, fmt: str) -> np.ndarray:
    from gguf.quants import GGMLQuantizationType, quantize

    return quantize(w.astype(np.float32), GGMLQuantizationType[fmt.upper()])


def test_int8_quantization_round_trips_within_half_a_step_per_column():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 48, 40)).astype(np.float32) * rng.uniform(0.01, 3, (3, 1, 40))
    q, scale = quantize_int8(w, group_size=48)          # one group = the whole column
    assert q.dtype == np.int8 and scale.shape == (3, 1, 40)
    assert np.all(np.abs(q.astype(np.float32) * scale - w) <= scale / 2 + 1e-7)
    assert np.abs(q).max() == 127          # each column's largest weight uses the full range


def test_int8_group_scales_round_trip_within_half_a_group_step_and_beat_per_column():
    rng = np.random.default_rng(5)
    # runs of input rows of very different magnitude: one per-column scale would waste
    # most levels on the small runs
    magnitude = np.repeat(np.exp(rng.uniform(-4, 1, (2, 3, 1))), 32, axis=1)
    w = (rng.standard_normal((2, 96, 40)) * magnitude).astype(np.float32)
    q, scale = quantize_int8(w)
    assert group_size_for(96) == 32 and scale.shape == (2, 3, 40)
    step = np.repeat(scale, 32, axis=1)                 # group g covers input rows 32g..32g+31
    assert np.all(np.abs(q.astype(np.float32) * step - w) <= step / 2 + 1e-7)
    assert (np.abs(q).max(axis=1) == 127).all()       # every group's top uses the full range
    np.testing.assert_array_equal(dequantize_int8(q, scale), q.astype(np.float32) * step)
    per_column = dequantize_int8(*quantize_int8(w, group_size=96))
    # error relative to each run's magnitude: groups keep the small runs precise
    grouped_err = (np.abs(dequantize_int8(q, scale) - w) / magnitude).mean()
    assert grouped_err < 0.5 * (np.abs(per_column - w) / magnitude).mean()
    assert group_size_for(576) == 32 and group_size_for(50) == 50   # no divisor: per column


@pytest.mark.parametrize("fmt", sorted(BYTES_PER_BLOCK))
def test_packed_dequantize_in_jit_equals_gguf_py_bit_for_bit(fmt):
    from gguf.quants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(1)
    if fmt.endswith("_k"):   # gguf-py reads the K-quants but cannot write them: random blocks
        from tests.test_gguf_kernels import random_blocks

        packed = random_blocks(rng, fmt, 24, 512, layers=2)
        assert packed.shape == (2, 24, 2 * BYTES_PER_BLOCK[fmt])
    else:
        w = rng.standard_normal((2, 24, 96)).astype(np.float32)
        packed = _gguf_pack(w, fmt)
        assert packed.dtype == np.uint8 and packed.shape == (2, 24, 3 * BYTES_PER_BLOCK[fmt])
    ours = np.asarray(jax.jit(lambda p: dequantize(p, fmt))(packed))
    ref = gguf_dequantize(packed, GGMLQuantizationType[fmt.upper()])
    np.testing.assert_array_equal(ours, ref)
    if not fmt.endswith("_k"):
        assert np.abs(ours - w).max() < (0.02 if fmt == "q8_0" else 0.5)


def test_linear_reads_float_int8_and_packed_params_as_the_dequantized_matmul():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)          # [in, out]
    bias = rng.standard_normal(32).astype(np.float32)
    layer = Linear(32, use_bias=True)
    dense = layer.apply({"params": {"kernel": w, "bias": bias}}, x)
    np.testing.assert_allclose(dense, x @ w + bias, rtol=1e-5, atol=1e-5)
    for group in (32, 64):          # group-wise [in // g, out] and per column [out]
        q, scale = quantize_int8(w, group_size=group)
        if group == 64:
            scale = scale[0]
        int8 = layer.apply({"params": {"kernel": q, "scale": scale, "bias": bias}}, x)
        want = x @ dequantize_int8(q, scale.reshape(-1, 32)) + bias
        np.testing.assert_allclose(int8, want, rtol=1e-5, atol=1e-4)
    packed = _gguf_pack(w.T, "q4_1")                             # [out, packed in]
    deq = np.asarray(dequantize(packed, "q4_1"))
    y = layer.apply({"params": {"q4_1": packed, "bias": bias}}, x)
    np.testing.assert_allclose(y, x @ deq.T + bias, rtol=1e-5, atol=1e-4)


def test_packed_embedding_lookup_and_tied_head_use_the_dequantized_table():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    packed = _gguf_pack(table, "q8_0")
    deq = np.asarray(dequantize(packed, "q8_0"))
    emb = Embedding(50, 64)
    ids = jnp.asarray(rng.integers(0, 50, 7), jnp.int32)
    variables = {"params": {"q8_0": packed}}
    np.testing.assert_array_equal(emb.apply(variables, ids), deq[np.asarray(ids)])
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_allclose(emb.apply(variables, x, method="attend"), x @ deq.T,
                               rtol=1e-5, atol=1e-4)


def test_partition_specs_split_scales_with_columns_and_packed_rows_by_whole_blocks():
    spec = LLAMA.param_spec
    assert spec(("layers", "q_proj", "scale"), (2, 64), 2) == P(None, MODEL_AXIS)
    assert spec(("layers", "o_proj", "scale"), (2, 64), 2) == P()
    assert spec(("lm_head", "scale"), (512,), 2) == P(MODEL_AXIS)
    assert spec(("layers", "gate_proj", "q4_1"), (2, 128, 40), 2) == P(None, MODEL_AXIS, None)
    assert spec(("layers", "down_proj", "q4_1"), (2, 64, 80), 2) == P(None, None, MODEL_AXIS)
    assert spec(("embed_tokens", "q8_0"), (512, 68), 2) == P(MODEL_AXIS, None)
    with pytest.raises(ValueError, match="blocks"):
        spec(("layers", "down_proj", "q4_1"), (2, 64, 60), 2)     # 3 blocks over tp=2


def test_int8_engine_stores_int8_kernels_and_keeps_tiny_model_greedy_tokens(make_tiny_model):
    model_dir = make_tiny_model("llama")
    kwargs = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                  kv_cache_memory_bytes=2 << 20)
    ref = LLM(str(model_dir), **kwargs)
    llm = LLM(str(model_dir), quantization="int8", **kwargs)
    layers = llm.llm_engine.engine_core.setup.runner.params["params"]["layers"]
    assert layers["q_proj"]["kernel"].dtype == jnp.int8
    assert layers["down_proj"]["scale"].shape == (2, 128 // 32, 64)   # [L, in / 32, out]
    assert llm.llm_engine.engine_core.setup.runner.params["params"]["lm_head"]["kernel"].dtype == jnp.int8
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("Hello, world!", "The quick brown fox",
                                       "def add(a, b):", "Paged attention stores")]
    with compile_events() as compiles:     # quantized weights: still no compile after warm-up
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(prompts + [list(range(3, 60))], params, use_tqdm=False)
    assert compiles == [] and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    # A random tiny model's next-token distribution is nearly flat (greedy continuations
    # fork on near-ties), so compare teacher-forced logits: close, and mostly the same top-1.
    logits = np.concatenate([llm.llm_engine.prompt_logits(p) for p in prompts])
    ref_logits = np.concatenate([ref.llm_engine.prompt_logits(p) for p in prompts])
    spread = ref_logits.std()
    print("int8 tiny: max diff / spread", np.abs(logits - ref_logits).max() / spread,
          "top-1", np.mean(logits.argmax(-1) == ref_logits.argmax(-1)))
    assert np.abs(logits - ref_logits).max() < 0.1 * spread
    assert np.mean(logits.argmax(-1) == ref_logits.argmax(-1)) >= 0.8


def test_default_gguf_served_packed_is_close_to_hf_on_dequantized_weights(default_gguf_path,
                                                                         caplog):
    """The embedded GGUF with quantization unset, on one CPU: the blocks stay packed
    (engine/gguf_packing.py) and the library's block kernel reads them with x quantized to
    8 bits per 32-block, as llama.cpp does (kernels/cpu/gemv_gguf.h) -- close to, not equal
    to, the dequantized float model (HF on gguf-py's dequantization): its teacher-forced next
    tokens and greedy first tokens. The startup log says why, and quotes the measured cost."""
    from jaxserve.kernels.cpu import matmul
    from jaxserve.kernels.cpu.matmul import GGUF_TARGET
    from jaxserve.loader import load_model
    from jaxserve.quantization.gguf_packed import GGUF_BLOCK_ROWS
    from tests.hf_reference import hf_greedy, hf_logits, torch_model_from_weights

    if jax.default_backend() != "cpu" or not matmul.available():
        pytest.skip("packed by default only where the CPU's block kernels run")
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        llm = LLM(None, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                  kv_cache_memory_bytes=32 << 20)
    assert "GGUF weights kept packed" in caplog.text
    assert "measured cost of weights=gguf" in caplog.text and "top-1 agreement" in caplog.text
    setup = llm.llm_engine.engine_core.setup
    layers = setup.runner.params["params"]["layers"]
    assert layers["q_proj"]["q4_1"].dtype == jnp.uint8
    assert "q8_0" in setup.runner.params["params"]["embed_tokens"]
    from jaxserve.quantization.gguf_packed import PACKED_FORMATS

    blocks = sum(leaf.nbytes for path, leaf in
                 jax.tree_util.tree_leaves_with_path(setup.runner.params)
                 if getattr(path[-1], "key", None) in PACKED_FORMATS)
    assert 0 < blocks <= 0.2 * setup.num_params * 4
    # beside the blocks, their float copy (engine/gguf_packing.py): steps of at most
    # GGUF_BLOCK_ROWS rows read the blocks (the scan's q/k/v, o, gate/up, down calls), more
    # rows the copy through oneDNN (at most the tied LM head's call on the blocks remains)
    # on bf16 units stored side by side for q|k|v and gate|up (models/sibling_fusion.py:
    # one matmul each), elsewhere one copy per projection
    from jaxserve.kernels.cpu.matmul import current_matrix_units
    from jaxserve.models.sibling_fusion import fusion_pays

    fused = fusion_pays(setup.runner.dtype, current_matrix_units().bf16)
    copy = layers["qkv_proj"] if fused else layers["q_proj"]
    # the copy itself plain, or packed at startup for oneDNN (engine/weight_packing.py)
    packed = "packed_kernel" in layers["o_proj"]
    assert packed == setup.runner.plan.packed_weights
    if packed:
        assert copy["packed_kernel"].dtype == jnp.uint8 and setup.runner.dtype == jnp.bfloat16
    else:
        assert copy["kernel"].dtype == layers["o_proj"]["kernel"].dtype == setup.runner.dtype
    leaf = "packed_kernel" if packed else "kernel"
    assert (leaf not in layers["q_proj"]) == fused == ("gate_up_proj" in layers)
    runner = llm.llm_engine.engine_core.runner
    runner.wait_until_compiled()
    few, many = min(runner._steps), max(runner._steps)
    assert many[0] > GGUF_BLOCK_ROWS
    assert runner._steps[few].as_text().count(GGUF_TARGET) >= 4
    assert runner._steps[many].as_text().count(GGUF_TARGET) <= 1
    loaded = load_model(None)          # dequantized by gguf-py: the same quantized model
    hf = torch_model_from_weights(loaded.hf_config, loaded.weights)
    tok = llm.get_tokenizer()
    texts = ["Hello", "The capital of France is", "def fibonacci(n):",
             "Water boils at a temperature of", "Once upon a time, in a small village,",
             "List three primary colors:", "import numpy as np\n", "The meaning of life is"]
    prompts = [tok.encode(t) for t in texts]
    new = 16
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new,
                                                ignore_eos=True), use_tqdm=False)
    hf_tokens = [hf_greedy(hf, p, new) for p in prompts]
    first = sum(o.outputs[0].token_ids[0] == h[0] for o, h in zip(outs, hf_tokens))
    assert first >= 7, f"{first} of 8 first tokens equal HF's"
    agree, total = 0, 0
    for p, h in zip(prompts, hf_tokens):      # teacher-forced on HF's own continuations
        ids = p + h
        ours, theirs = llm.llm_engine.prompt_logits(ids), hf_logits(hf, ids)
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(ids)
    assert agree >= 0.9 * total, f"teacher-forced top-1 agreement {agree}/{total}"

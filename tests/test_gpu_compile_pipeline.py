"""`jaxserve compile -pp` for an H200 on this CPU-only machine (tier `gpu_compile`).

Each pipeline stage's programs are compiled for its own (1, tp) sub-mesh of the target's
compile-only devices and the KV cache is planned per stage by startup's planner
(engine/pipeline_memory.py) from the target's memory: a stage holds about half of pp = 1's
weights per device and at least pp = 1's KV tokens, the stage with the fewest blocks
decides, and every stage's widest program fits XLA's own limit with the planned cache.
Needs the compile-only extras (`make test-gpu-compile`); skipped without them.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from tests.gpu_compile_plugin import skip_module_unless_plugin_ready

pytestmark = pytest.mark.gpu_compile


skip_module_unless_plugin_ready()

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine.aot_compile import compile_for_target  # noqa: E402
from jaxserve.entrypoints.compile import describe  # noqa: E402
from jaxserve.platforms.gpu_targets import load_target  # noqa: E402
from jaxserve.runner.memory import XLA_GPU_SLOP_PERCENT, xla_base_limit_bytes  # noqa: E402

SHAPES = Path(__file__).resolve().parents[1] / "configs" / "models"
# XLA's complaints when a step's arguments leave its scheduler no memory, or its
# rematerialization cannot meet its limit (as tests/test_gpu_compile.py reads them).
_XLA_MEMORY_COMPLAINTS = re.compile(r".*(?:exceeds the base limit|Can't reduce memory use).*")


def _model(directory: Path, base: str, **changes) -> Path:
    """A directory holding only a config.json: `base`'s shapes with `changes`."""
    config = json.loads((SHAPES / base / "config.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return directory


def _config(model: Path, **overrides) -> EngineConfig:
    kwargs = {"model": str(model), "dtype": "bfloat16", "max_model_len": 2048,
              "max_num_seqs": 8, "max_num_batched_tokens": 64, "load_format": "dummy",
              "skip_tokenizer_init": True}
    return EngineConfig.from_kwargs(**{**kwargs, **overrides})


def test_a_pp2_stage_holds_half_the_weights_and_at_least_pp1s_kv_tokens(tmp_path):
    """Llama shapes small enough to compile fast (hidden 1024, 4 layers, a 32k vocabulary:
    the embeddings weigh about two layers, as in a real model), --plan-only on an H200 at
    pp = 1 and pp = 2: each stage's weights per device are about half of pp = 1's; the
    cache holds at least pp = 1's tokens (a stage's block costs half the bytes: its layers
    only); the stage whose memory holds the fewest blocks decides the engine's count."""
    model = _model(tmp_path / "model", "llama-3-8b", hidden_size=1024,
                   intermediate_size=4096, num_attention_heads=8, num_key_value_heads=8,
                   num_hidden_layers=4, vocab_size=32768)
    one = compile_for_target(_config(model), "h200", tmp_path / "pp1", plan_only=True)
    two = compile_for_target(_config(model, pipeline_parallel_size=2), "h200",
                             tmp_path / "pp2", plan_only=True)
    assert one["pipeline_parallel_size"] == 1 and "stages" not in one
    assert two["pipeline_parallel_size"] == 2 and two["devices"] == 2
    stages = two["stages"]
    assert [(s["layers"], s["devices"]) for s in stages] == [([0, 2], [0]), ([2, 4], [1])]
    for stage in stages:
        ratio = stage["weights_bytes_per_device"] / one["weights_bytes_per_device"]
        assert 0.45 < ratio < 0.55, (stage["stage"], ratio)
        assert stage["kv_cache_bytes_per_block"] * 2 == one["kv_cache_bytes_per_device"] // \
            one["kv_cache_blocks"]
        assert stage["temp_bytes"] > 0 and stage["own_kv_cache_blocks"] >= two["kv_cache_blocks"]
    assert two["kv_cache_tokens"] >= one["kv_cache_tokens"]
    # the deciding stage is the one whose memory holds the fewest blocks, and its count is
    # the engine's
    (decider,) = [s for s in stages if s["decides"]]
    assert decider["own_kv_cache_blocks"] == two["kv_cache_blocks"] == \
        min(s["own_kv_cache_blocks"] for s in stages)
    # each probe bucket was compiled once per stage
    assert all(len(b["stage_temp_bytes"]) == 2 for b in two["buckets"])
    text = describe(two)
    assert "pp 2 x tp 1" in text and "stage 1: layers 2-3 on devices 1" in text
    assert "(decides)" in text and "(plan only)" in text


def test_pp2_tp8_stages_compile_within_xlas_memory_limit(tmp_path, capfd):
    """Llama-3-70B's layer shapes at pp 2 x tp 8 on 16 compile-only H200s (4 of its layers,
    2 per stage, for the tier's time), the widest bucket compiled against the planned
    cache: each stage's program -- its weights and its own KV cache as arguments, its
    temporaries over XLA's slop factor -- stays inside XLA's base limit (80 % of the H200),
    XLA logs no memory complaint, and the deciding stage's cache fills the room its weights
    leave (a cache far under the limit would pass anything). The bucket's file holds one
    serialized executable per stage, and the manifest each stage's plan."""
    model = _model(tmp_path / "model", "llama-3-70b", num_hidden_layers=4)
    config = _config(model, max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=1024,
                     tensor_parallel_size=8, pipeline_parallel_size=2)
    capfd.readouterr()
    out = tmp_path / "out"
    summary = compile_for_target(config, "h200", out, shapes=[(1024, 64)])
    complaints = [m.group(0) for m in _XLA_MEMORY_COMPLAINTS.finditer(capfd.readouterr().err)]
    assert complaints == [], complaints
    base = xla_base_limit_bytes(load_target("h200").device_memory_bytes)
    (bucket,) = summary["buckets"]
    stages = summary["stages"]
    assert summary["devices"] == 16 and [s["devices"] for s in stages] == \
        [list(range(8)), list(range(8, 16))]
    for stage, temp, io in zip(stages, bucket["stage_temp_bytes"], bucket["stage_io_bytes"]):
        assert io >= stage["kv_cache_bytes_per_device"] + stage["weights_bytes_per_device"]
        assert io + temp * 100 // XLA_GPU_SLOP_PERCENT <= base, stage["stage"]
    (decider,) = [s for s in stages if s["decides"]]
    assert decider["own_kv_cache_blocks"] == summary["kv_cache_blocks"]
    assert decider["kv_cache_bytes_per_device"] > \
        0.9 * (base - decider["resident_bytes_per_device"])
    # at 90 % of an H200 the compiler's limit is the tighter bound (runner/memory.py)
    assert [s["bound_by"] for s in stages] == ["XLA's limit"] * 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_cache_blocks"] == summary["kv_cache_blocks"]
    assert manifest["pipeline_parallel_size"] == 2 and len(manifest["stages"]) == 2
    assert manifest["devices"] == 16
    stage_programs = pickle.loads((out / bucket["file"]).read_bytes())
    assert len(stage_programs) == 2 and (out / bucket["file"]).stat().st_size == \
        bucket["serialized_bytes"] > 0


def test_more_stages_than_layers_is_one_line_error(tmp_path, capsys):
    from jaxserve.entrypoints.cli import main

    model = _model(tmp_path / "model", "llama-3-8b", num_hidden_layers=2)
    code = main(["compile", str(model), "--target", "h200", "--output", str(tmp_path / "out"),
                 "--plan-only", "--load-format", "dummy", "--skip-tokenizer-init", "-pp", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "pipeline_parallel_size=3 exceeds the model's 2 layers" in err
    assert not (tmp_path / "out").exists()


def test_lora_slots_compile_per_stage(make_tiny_model):
    """--enable-lora with pp = 2: each stage's program takes its own layers' adapter slots,
    placed on its own device, and compiles for the H200 with the Pallas kernel."""
    from jaxserve.engine.aot_compile import build_abstract_engine, compile_bucket

    config = EngineConfig.from_kwargs(
        model=str(make_tiny_model("llama")), max_model_len=256, max_num_seqs=8,
        max_num_batched_tokens=64, load_format="dummy", pipeline_parallel_size=2,
        enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = build_abstract_engine(config, "h200", None)
    stacks = engine.runner._lora_stacks()
    assert len(stacks) == 2
    for index, stage in enumerate(stacks):
        lora_a = stage["q_proj"]["lora_a"]
        assert lora_a.shape[:2] == (1, 3)           # its one layer; max_loras + the base slot
        assert [d.id for d in lora_a.sharding.device_set] == [index]
    compiled = compile_bucket(engine.runner, engine.runner.buckets.all_shapes()[0], "h200")
    assert len(compiled.executable.stages) == 2
    assert all("__gpu$xla.gpu.triton" in stage.as_text() for stage in compiled.executable.stages)

"""What quantization unset means for a GGUF file (engine/gguf_packing.py): packed on a CPU
where the block kernels run, dequantized everywhere else and whenever the user asks for a
float dtype or `--quantization none`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.gguf_packing import gguf_default_quantization, settle_packed
from jaxserve.kernels.cpu import matmul

GGUF = "/models/smollm2-135m-instruct.Q4_1.gguf"
needs_library = pytest.mark.skipif(not matmul.available(),
                                   reason="needs the CPU kernel library (onednn-cpu-gomp)")


def _rule(path: str = GGUF, mesh=None, platform: str = "cpu", **kwargs):
    return gguf_default_quantization(EngineConfig.from_kwargs(**kwargs), path, mesh, platform)


@pytest.mark.fast
@needs_library
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "bf16"])
def test_a_gguf_on_one_cpu_is_served_packed(dtype):
    mode, why = _rule(dtype=dtype)
    assert mode == "gguf" and "kept packed" in why


@pytest.mark.fast
@pytest.mark.parametrize("kwargs, platform, reason", [
    ({}, "gpu", "the CPU's"),
    ({"tensor_parallel_size": 3}, "cpu", "several devices"),
    ({"pipeline_parallel_size": 2}, "cpu", "several devices"),
    ({"dtype": "float32"}, "cpu", "dtype=float32"),
    ({"dtype": "float16"}, "cpu", "dtype=float16"),
    ({"aot_dir": "/compiled"}, "cpu", "--aot-dir"),
])
def test_a_gguf_is_dequantized_where_packed_blocks_would_be_slower_or_unasked(
        kwargs, platform, reason):
    mode, why = _rule(platform=platform, **kwargs)
    assert mode is None and why.startswith("GGUF weights dequantized") and reason in why


@pytest.mark.fast
def test_a_mesh_of_several_devices_dequantizes():
    mode, why = _rule(mesh=SimpleNamespace(size=2))
    assert mode is None and "several devices" in why


@pytest.mark.fast
@pytest.mark.parametrize("quantization", ["none", "gguf", "int8"])
def test_an_explicit_mode_is_the_users_and_needs_no_reason(quantization):
    assert _rule(quantization=quantization, platform="gpu") == (quantization, None)


@pytest.mark.fast
def test_other_sources_and_dummy_weights_are_left_alone():
    assert _rule(path="/models/llama") == (None, None)
    assert _rule(load_format="dummy") == (None, None)


@pytest.mark.fast
def test_a_file_with_nothing_packable_is_reported_plain():
    float_file = {"layers.q_proj.kernel": 0, "embed_tokens": 0}
    packed_file = {"layers.q_proj.q4_1": 0, "embed_tokens": 0}
    assert settle_packed("gguf", True, float_file) is None
    assert settle_packed("gguf", True, packed_file) == "gguf"
    assert settle_packed("gguf", False, float_file) == "gguf"    # asked for: the user's word
    assert settle_packed("awq", False, float_file) == "awq"


@pytest.mark.fast
def test_the_command_line_takes_quantization_none(capsys):
    from jaxserve.entrypoints.cli import main

    assert main(["serve", "--quantization", "none", "--print-config"]) == 0
    assert "quantization: none" in capsys.readouterr().out.splitlines()

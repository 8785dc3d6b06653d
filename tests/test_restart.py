"""Restarts from a converted orbax checkpoint (`jaxserve convert`, loader/orbax_checkpoint.py).

One worker subprocess with 2 simulated CPU devices (this file run as a script) converts a
tiny Llama at tp = 1 and tp = 2, with and without int8, and serves original and converted
side by side; the tests compare their greedy tokens. A second subprocess restores a
checkpoint and generates, then reports whether torch was ever imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import precision

REPO = Path(__file__).resolve().parents[1]
# Two step buckets per engine: compiling is nearly all of this file's cost.
ENGINE_KWARGS = {"max_model_len": 64, "max_num_batched_tokens": 2, "max_num_seqs": 2,
                 "kv_cache_memory_bytes": 2 << 20, **precision.EXACT}
PROMPTS = [[11, 23, 98], [7] + list(range(40, 52)), [250]]
MAX_TOKENS = 6


def _env(num_devices: int, cache_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # One persistent compilation cache for the file's engines: an original and its restored
    # copy at tp = 2 run the same executables (compiled once).
    env["JAXSERVE_TEST_CACHE"] = str(cache_dir)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    return env


# =================================================================================================
# The worker (2 simulated devices)
# =================================================================================================
def _generate(model: str, stats: dict | None = None, **kwargs) -> list[list[int]]:
    return _generate_with(model, {**ENGINE_KWARGS, **kwargs}, stats)


def _generate_with(model: str, engine_kwargs: dict, stats: dict | None = None
                   ) -> list[list[int]]:
    import gc

    from jaxserve import LLM, SamplingParams

    llm = LLM(model, compilation_cache_dir=os.environ["JAXSERVE_TEST_CACHE"], **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    if stats is not None:
        runner = llm.llm_engine.engine_core.runner
        cache = runner.executable_cache
        stats.update(shapes=len(runner.compiled_shapes), hits=cache.hits, misses=cache.misses,
                     dtype=np.dtype(runner.dtype).name)
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs]


def worker(spec: dict) -> None:
    from jaxserve.entrypoints.convert import convert_model

    model, root = spec["model"], Path(spec["root"])
    results: dict = {}
    for quantization in (None, "int8"):
        tag = quantization or "float"
        for tp in (1, 2):
            out = root / f"{tag}-tp{tp}"
            convert_model(model, str(out), quantization=quantization, tensor_parallel_size=tp)
            results[f"{tag}/tp{tp}/original"] = _generate(model, quantization=quantization,
                                                          tensor_parallel_size=tp)
            results[f"{tag}/tp{tp}/restored"] = _generate(str(out), tensor_parallel_size=tp)
    # Converted at tp = 1, served at tp = 2: each device restores only its shards.
    results["float/tp2/restored-from-tp1"] = _generate(str(root / "float-tp1"),
                                                       tensor_parallel_size=2)
    results.update(_across_cpu_kinds(model, root))
    Path(spec["out"]).write_text(json.dumps(results))


def _as_cpu_kind(kind: str, run):
    """run() with every engine config made meanwhile defaulting to matrix_units=kind."""
    before = os.environ.get("JAXSERVE_MATRIX_UNITS")
    os.environ["JAXSERVE_MATRIX_UNITS"] = kind
    try:
        return run()
    finally:
        if before is None:
            del os.environ["JAXSERVE_MATRIX_UNITS"]
        else:
            os.environ["JAXSERVE_MATRIX_UNITS"] = before


def _across_cpu_kinds(model: str, root: Path) -> dict:
    """Convert with no dtype as a CPU without bf16 units and as one with them (where
    dtype=auto means float32 and bfloat16); serve the first as the second kind with
    dtype=auto, beside the original model served that way."""
    from jaxserve.entrypoints.convert import convert_model
    from jaxserve.loader.orbax_checkpoint import read_checkpoint

    out: dict = {}
    for kind in ("none", "avx512"):
        path = root / f"kind-{kind}"
        _as_cpu_kind(kind, lambda path=path: convert_model(model, str(path)))
        out[f"kinds/{kind}/manifest_dtype"] = read_checkpoint(path).dtype
        out[f"kinds/{kind}/params_digest"] = _params_digest(path)
    auto = {**ENGINE_KWARGS, "dtype": "auto"}
    for name, source in (("original", model), ("restored", str(root / "kind-none"))):
        stats: dict = {}
        out[f"kinds/avx512/{name}"] = _as_cpu_kind(
            "avx512", lambda source=source, stats=stats: _generate_with(source, auto, stats))
        out[f"kinds/avx512/{name}/dtype"] = stats["dtype"]
    return out


def _params_digest(checkpoint: Path) -> str:
    """sha256 over the checkpoint's restored arrays (names, dtypes and bytes)."""
    import hashlib

    import jax
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(checkpoint / "params")
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def torch_free_worker(checkpoint: str) -> None:
    """Restore and generate; print whether anything imported torch on the way, the tokens,
    and how many step executables were loaded serialized rather than compiled."""
    stats: dict = {}
    tokens = _generate(checkpoint, stats)
    print(json.dumps({"torch_imported": "torch" in sys.modules, "tokens": tokens, **stats}))


# =================================================================================================
# The tests
# =================================================================================================
@pytest.fixture(scope="module")
def round_trip(make_tiny_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("restart")
    out = root / "results.json"
    spec = {"model": str(make_tiny_model("llama")), "root": str(root), "out": str(out)}
    proc = subprocess.run([sys.executable, __file__, "worker", json.dumps(spec)],
                          env=_env(2, root / "jax-cache"),
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    if not out.exists():
        pytest.fail(f"restart worker produced nothing (exit {proc.returncode}):\n"
                    f"{proc.stderr[-5000:]}")
    return {"root": root, **json.loads(out.read_text())}


@pytest.mark.parametrize("quantization", ["float", "int8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_converted_checkpoint_serves_the_same_greedy_tokens(round_trip, quantization, tp):
    original = round_trip[f"{quantization}/tp{tp}/original"]
    assert len(original) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in original)
    assert round_trip[f"{quantization}/tp{tp}/restored"] == original


def test_convert_writes_the_same_checkpoint_on_every_cpu_kind(round_trip):
    """No --dtype: the model's own (float32 here), not what dtype=auto means where it runs
    (float32 on a CPU without bf16 units, bfloat16 on one with them)."""
    assert round_trip["kinds/none/manifest_dtype"] == "float32"
    assert round_trip["kinds/avx512/manifest_dtype"] == "float32"
    assert round_trip["kinds/none/params_digest"] == round_trip["kinds/avx512/params_digest"]


def test_a_checkpoint_converted_on_one_cpu_kind_serves_as_the_other(round_trip):
    """Converted as an AVX2-only CPU, served with dtype=auto as an AVX512-BF16 one: bfloat16
    there, cast while restored, the same tokens as the original model loaded there."""
    assert round_trip["kinds/avx512/original/dtype"] == "bfloat16"
    assert round_trip["kinds/avx512/restored/dtype"] == "bfloat16"
    original = round_trip["kinds/avx512/original"]
    assert len(original) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in original)
    assert round_trip["kinds/avx512/restored"] == original


def test_a_tp1_checkpoint_restores_sharded_at_tp2(round_trip):
    assert round_trip["float/tp2/restored-from-tp1"] == round_trip["float/tp2/original"]


def test_int8_checkpoint_stores_int8_kernels(round_trip):
    from jaxserve.loader.orbax_checkpoint import read_checkpoint

    root = round_trip["root"]
    info = read_checkpoint(root / "int8-tp2")
    assert info.quantization == "int8" and info.manifest["converted_tensor_parallel_size"] == 2
    import jax
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().metadata(root / "int8-tp2" / "params").item_metadata.tree
    dtypes = {jax.tree_util.keystr(path): str(leaf.dtype)
              for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
    kernels = [d for key, d in dtypes.items() if "kernel" in key and "layers" in key]
    assert len(kernels) == 7 and set(kernels) == {"int8"}, dtypes     # q k v o gate up down
    assert dtypes["['params']['norm']['weight']"] == "float32"


def test_a_restart_never_imports_torch_and_loads_serialized_steps(round_trip):
    """A fresh process serving the checkpoint the worker served (same devices, settings and
    cache directory): no torch, every step executable loaded serialized, same tokens."""
    checkpoint = round_trip["root"] / "float-tp1"
    proc = subprocess.run([sys.executable, __file__, "torch-free", str(checkpoint)],
                          env=_env(2, round_trip["root"] / "jax-cache"), cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch_imported"] is False
    assert report["tokens"] == round_trip["float/tp1/restored"]
    assert report["shapes"] == 2 and (report["hits"], report["misses"]) == (2, 0)


def test_checkpoint_settings_cannot_be_silently_overridden(round_trip):
    from jaxserve import LLM

    checkpoint = str(round_trip["root"] / "int8-tp1")
    # Both are refused while reading the manifest, before any array is restored.
    with pytest.raises(ValueError, match="converted with quantization='int8'"):
        LLM(checkpoint, quantization="gguf", compilation_cache_dir="off", **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="converted in float32"):
        LLM(checkpoint, compilation_cache_dir="off", **{**ENGINE_KWARGS, "dtype": "bfloat16"})


def test_convert_refuses_a_non_empty_directory(make_tiny_model, tmp_path):
    from jaxserve.entrypoints.convert import convert_model

    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_model(str(make_tiny_model("llama")), str(tmp_path))
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_cli_convert_writes_a_self_contained_checkpoint(make_tiny_model, tmp_path, capsys):
    from jaxserve.entrypoints.cli import main
    from jaxserve.loader.orbax_checkpoint import load_checkpoint_tokenizer, read_checkpoint

    model = make_tiny_model("llama")
    out = tmp_path / "ckpt"
    assert main(["convert", str(model), str(out), "--quantization", "int8",
                 "--dtype", "float32", "--log-level", "warning"]) == 0
    assert f"jaxserve serve {out}" in capsys.readouterr().out
    info = read_checkpoint(out)
    assert (info.quantization, info.dtype, info.kv_head_copies) == ("int8", "float32", 1)
    assert info.hf_config.num_key_value_heads == 2 and info.generation_config["eos_token_id"]
    assert load_checkpoint_tokenizer(out).encode("hello world") == \
        load_checkpoint_tokenizer(model).encode("hello world")
    # Converting a converted checkpoint is refused with a one-line error.
    assert main(["convert", str(out), str(tmp_path / "again")]) == 2
    assert "already a converted checkpoint" in capsys.readouterr().err


def test_executable_cache_notices_a_jax_persistent_cache_hit(tmp_path):
    """A step read back from JAX's cache is not stored (XLA:CPU serializes it without its
    kernels); the cache must tell such a compile from a fresh one."""
    import jax
    import jax.numpy as jnp

    from jaxserve.engine.model_setup import enable_compilation_cache
    from jaxserve.runner.executable_cache import ExecutableCache

    cache = ExecutableCache(tmp_path / "executables", "key")
    # A constant of its own: a function no earlier run can have put in any JAX cache (an
    # earlier LLM() in this process may have fixed the cache directory already).
    scale = 1.0 + int.from_bytes(os.urandom(4), "little") / 2**33
    before = jax.config.jax_compilation_cache_dir
    enable_compilation_cache(str(tmp_path / "jax"))
    try:
        def compile_once():
            with cache.compiling() as hit:
                jax.jit(lambda x: jnp.sin(x) * scale + 1.0).lower(jnp.ones(7)).compile()
                return hit()

        first = compile_once()
        jax.clear_caches()                # forget in memory; the persistent cache keeps it
        assert (first, compile_once()) == (False, True)
    finally:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()


def test_resolve_detects_a_converted_checkpoint(round_trip):
    from jaxserve.loader.resolve import resolve_model

    resolved = resolve_model(round_trip["root"] / "float-tp1")
    assert resolved.format == "orbax"


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(json.loads(sys.argv[2]))
    else:
        torch_free_worker(sys.argv[2])

"""Every platform rule lives in jaxserve/platforms/: nothing else asks which platform it is on.

A grep over the package's source for the ways a module asks (jax's default backend, a device's
or a variable's platform compared with a name, a name like "cpu" compared with anything).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jaxserve.config import EngineConfig

PACKAGE = Path(__file__).resolve().parents[1] / "jaxserve"
PLATFORM_NAMES = r"""["'](?:cpu|gpu|cuda|rocm|tpu)["']"""
ASKING = re.compile("|".join([
    r"default_backend\(",                                    # jax.default_backend()
    r"\bplatform\w*\s*(?:==|!=|\bin\b|\bnot in\b)",          # platform == ..., on_platform in
    r"\.platform\s*(?:==|!=|\bin\b|\bnot in\b)",             # device.platform == ...
    rf"(?:==|!=)\s*{PLATFORM_NAMES}",                        # ... == "cpu"
    rf"{PLATFORM_NAMES}\s*(?:==|!=)",                        # "cpu" == ...
    rf"\bin\s*\(\s*{PLATFORM_NAMES}",                        # ... in ("gpu", "cuda")
]))
# The attention backend named "cpu" (the C++ kernel) is a backend, not a platform.
ALLOWED = {
    ("attention/backend.py", 'if name == "cpu":'),
    ("runner/execution_plan.py",
     'if backend_name == "cpu" and num_devices == 1 and jnp.dtype(dtype) in IN_PLACE_DTYPES \\'),
}


def _platform_questions() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("platforms/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if ASKING.search(code) and (relative, line.strip()) not in ALLOWED:
                found.append((relative, number, line.strip()))
    return found


@pytest.mark.fast
def test_no_module_outside_platforms_asks_which_platform_it_is_on():
    assert _platform_questions() == []


@pytest.mark.fast
def test_the_grep_finds_each_way_of_asking(tmp_path):
    """The pattern is not vacuous: each form a platform question took before matches it."""
    for line in ('platform = jax.default_backend()', 'if platform == "cpu":',
                 'on_gpu = self._params_platform() in ("gpu", "cuda", "rocm")',
                 'tp_size if device.platform == "cpu" else 1', 'if platform != "cpu" or x:',
                 'return "pallas" if platform in GPU_PLATFORMS else "reference"'):
        assert ASKING.search(line), line
    assert not ASKING.search('if name == "pallas-interpret":')


@pytest.mark.fast
def test_the_resolved_config_is_read_only_and_the_users_is_untouched():
    from jaxserve.platforms import CpuPlatform, GpuPlatform

    config = EngineConfig.from_kwargs(max_model_len=512)
    on_cpu, on_gpu = CpuPlatform().resolve_config(config), GpuPlatform().resolve_config(config)
    assert config.scheduler_config.max_num_batched_tokens is None
    assert on_cpu.scheduler_config.max_num_batched_tokens == 512
    assert on_gpu.scheduler_config.max_num_batched_tokens == 2048
    with pytest.raises(AttributeError, match="read-only"):
        on_cpu.scheduler_config.max_num_seqs = 3
    with pytest.raises(AttributeError, match="read-only"):
        on_cpu.model_config = None
    changed = on_cpu.with_changes(scheduler_config={"max_num_batched_tokens": 1024})
    assert changed.scheduler_config.max_num_batched_tokens == 1024 and changed.is_resolved
    assert on_cpu.scheduler_config.max_num_batched_tokens == 512
    config.scheduler_config.max_num_seqs = 7           # the user's tree stays writable
    assert on_cpu.scheduler_config.max_num_seqs != 7


@pytest.mark.fast
def test_each_platform_answers_its_rules():
    import jax.numpy as jnp

    from jaxserve.platforms import platform_for_target, platform_named

    cpu, h200 = platform_named("cpu"), platform_for_target("h200")
    assert not cpu.unroll_layers and h200.unroll_layers and platform_named("tpu").unroll_layers
    assert cpu.memory_is_host_ram and not h200.memory_is_host_ram
    assert cpu.auto_dtype is None and h200.auto_dtype == jnp.bfloat16
    assert h200.device_memory_bytes >= 140 * 2**30 and cpu.device_memory_bytes is None
    assert cpu.step_compiler_options() is None
    assert h200.step_compiler_options()["xla_gpu_dot_merger_threshold_mb"] == 0
    with pytest.raises(ValueError, match="runs on the CPU platform only"):
        h200.attention_backend_name("cpu")
    with pytest.raises(ValueError, match="unsupported platform"):
        platform_named("metal")

"""The model registry: one list of architectures, the README table, dummy weights for all."""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxserve.loader import SUPPORTED_ARCHITECTURES, load_model
from jaxserve.models import registry
from tests.test_gemma import GEMMA2, GEMMA3
from tests.test_moe import MIXTRAL, QWEN3_MOE

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

# A tiny test model per registered architecture (make_tiny_model arguments): registering an
# architecture without one fails test_every_registered_architecture_has_a_tiny_test_model.
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("llama", {}),
    "MistralForCausalLM": ("mistral", {"sliding_window": 8}),
    "Qwen2ForCausalLM": ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
                                   "max_window_layers": 1}),
    "Qwen3ForCausalLM": ("qwen3", {}),
    "Gemma2ForCausalLM": GEMMA2,
    "Gemma3ForCausalLM": GEMMA3,
    "MixtralForCausalLM": MIXTRAL,
    "Qwen3MoeForCausalLM": QWEN3_MOE,
}


def test_every_registered_architecture_has_a_tiny_test_model():
    assert sorted(TINY_MODELS) == sorted(registry.supported_architectures())


def test_loader_lists_the_registry_architectures():
    assert SUPPORTED_ARCHITECTURES == registry.supported_architectures()


def test_readme_architecture_table_is_the_registry_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = registry.architecture_table_markdown()
    assert table in readme, f"README's table is stale; paste:\n{table}"
    assert all(f"`{a}`" in table for a in registry.supported_architectures())


def test_unsupported_architecture_error_names_every_registered_one():
    with pytest.raises(ValueError, match="unsupported architecture") as error:
        registry.resolve_architecture(["FalconForCausalLM"], "falcon", "config.json")
    assert all(a in str(error.value) for a in registry.supported_architectures())
    with pytest.raises(ValueError, match="not supported") as error:
        registry.gguf_family("falcon", "x.gguf")
    assert "llama" in str(error.value)


@pytest.mark.parametrize("architecture", sorted(TINY_MODELS))
def test_dummy_weights_have_the_checkpoint_layout_for_every_architecture(
        make_tiny_model, tmp_path, architecture):
    arch_name, overrides = TINY_MODELS[architecture]
    model_dir = make_tiny_model(arch_name, **overrides)
    real = load_model(str(model_dir))
    assert real.architecture == architecture
    config_only = tmp_path / "config-only"
    shutil.copytree(model_dir, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    dummy = load_model(str(config_only), load_format="dummy", dtype="bfloat16")
    assert {k: v.shape for k, v in dummy.weights.items()} == \
        {k: v.shape for k, v in real.weights.items()}
    assert all(w.dtype == ml_dtypes.bfloat16 for w in dummy.weights.values())
    assert all(np.isfinite(w.astype(np.float32)).all() for w in dummy.weights.values())
    arch = registry.read_arch(dummy.hf_config)
    family = registry.family_for(architecture)
    params = family.params_from_weights(dummy.weights, arch)["params"]
    assert set(params["layers"]) >= {"q_proj", "o_proj"}
    assert set(params["layers"]) & {"down_proj", "experts_down_proj"}   # dense MLP or experts


@pytest.mark.parametrize("config_class, architecture, overrides", [
    ("Gemma2Config", "Gemma2ForCausalLM", {}),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16,
                                         "max_window_layers": 2}),
    ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16})])
def test_windows_without_layer_types_follow_the_older_transformers_rules(config_class,
                                                                       architecture, overrides):
    # transformers >= 4.45 is allowed; before 5 configs had no layer_types.
    import transformers

    config = getattr(transformers, config_class)(num_hidden_layers=7, **overrides)
    config.architectures = [architecture]
    windows = registry.read_arch(config).layer_windows
    assert any(windows) and (not all(windows) or architecture == "MistralForCausalLM")
    config.layer_types = None
    assert registry.read_arch(config).layer_windows == windows

"""The tables every decoder family shares (models/family.py, models/arch.py), defined once:
each family's options carry the decoder's contract, its checkpoint names and weight shapes
come from the shared pieces, and every weight it expects has a checkpoint name."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from jaxserve.models import registry
from jaxserve.models.arch import DecoderOptions
from jaxserve.models.family import (
    GATED_MLP_TENSORS,
    PRE_NORM_TENSORS,
    arch_from_config,
    attention_extra_shapes,
    attention_tensors,
)
from tests.test_registry import TINY_MODELS

pytestmark = pytest.mark.fast  # the pre-commit tier: `make test-fast`

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True)
MODEL_TYPES = {arch: model_type for name in registry.supported_architectures()
               for model_type, arch in registry.family_for(name).model_types.items()}


def _arch(architecture: str):
    kind, extra = TINY_MODELS[architecture]
    extra = {k: v for k, v in extra.items() if k not in SMALL and k != "layer_types"}
    config = AutoConfig.for_model(MODEL_TYPES[architecture], **SMALL, **extra)
    family = registry.family_for(architecture)
    return family, family.read_config(config, architecture)


@pytest.mark.parametrize("architecture", sorted(TINY_MODELS))
def test_every_family_options_extend_the_decoder_contract(architecture):
    family, arch = _arch(architecture)
    assert isinstance(arch.options, DecoderOptions)
    base = {f.name for f in dataclasses.fields(DecoderOptions)}
    assert base <= {f.name for f in dataclasses.fields(arch.options)}
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.hidden_size) == (4, 2, 8, 32)


@pytest.mark.parametrize("architecture", sorted(TINY_MODELS))
def test_every_expected_weight_has_a_checkpoint_name(architecture):
    family, arch = _arch(architecture)
    shapes = family.weight_shapes(arch)
    for name in shapes:
        layer_name = name.removeprefix("layers.")
        if name.startswith("layers."):
            assert layer_name in family.layer_tensors, name
        else:
            assert name in family.global_tensors, name
    # the family takes every attention tensor's names from the one shared table
    attn = attention_tensors()
    attention = [n.removeprefix("layers.") for n in shapes if n.split(".")[1:2] and
                 n.split(".")[1] in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    assert len(attention) >= 4
    for name in attention:
        assert family.layer_tensors[name] == attn[name], name


def test_shared_tensor_names_are_hf_and_llama_cpp_names():
    attn = attention_tensors()
    assert attn["q_proj.kernel"] == ("self_attn.q_proj.weight", "attn_q.weight")
    assert attn["o_proj.bias"] == ("self_attn.o_proj.bias", "attn_output.bias")
    assert attn["k_norm"] == ("self_attn.k_norm.weight", "attn_k_norm.weight")
    assert len(attn) == 10
    assert PRE_NORM_TENSORS["post_attention_layernorm"][1] == "ffn_norm.weight"
    assert GATED_MLP_TENSORS["down_proj.kernel"] == ("mlp.down_proj.weight", "ffn_down.weight")


def test_optional_attention_shapes():
    _, arch = _arch("LlamaForCausalLM")
    assert attention_extra_shapes(arch) == {}
    assert attention_extra_shapes(arch, qkv_bias=True, o_bias=True, qk_norm=True) == {
        "q_proj.bias": (32,), "k_proj.bias": (16,), "v_proj.bias": (16,),
        "o_proj.bias": (32,), "q_norm": (8,), "k_norm": (8,)}


def test_arch_from_config_defaults_and_overrides():
    # a config without the optional fields: MHA, head_dim = hidden / heads, family defaults
    config = SimpleNamespace(vocab_size=64, hidden_size=32, intermediate_size=48,
                             num_hidden_layers=2, num_attention_heads=4)
    options = DecoderOptions(rms_norm_eps=1e-6)
    arch = arch_from_config(config, "LlamaForCausalLM", options, (0, 0), intermediate_size=7,
                            max_position_embeddings=99, tie_word_embeddings=True)
    assert arch.num_kv_heads == 4 and arch.head_dim == 8
    assert arch.intermediate_size == 7 and arch.options is options
    assert arch.max_position_embeddings == 99 and arch.tie_word_embeddings is True
    assert arch_from_config(config, "LlamaForCausalLM", options, (0, 0), head_dim=16).head_dim == 16
    config.max_position_embeddings, config.tie_word_embeddings = 512, False   # the config wins
    arch = arch_from_config(config, "LlamaForCausalLM", options, (0, 0),
                            max_position_embeddings=99, tie_word_embeddings=True)
    assert (arch.max_position_embeddings, arch.tie_word_embeddings) == (512, False)

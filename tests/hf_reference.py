"""Hugging Face (torch, CPU, float32) reference models for parity tests."""

from __future__ import annotations

import copy

import numpy as np
import torch
import transformers

# HF per-layer suffix -> (our name, stored transposed in our layout)
HF_LAYER = {
    "input_layernorm.weight": ("input_layernorm", False),
    "post_attention_layernorm.weight": ("post_attention_layernorm", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    **{f"self_attn.{p}_proj.weight": (f"{p}_proj.kernel", True) for p in "qkvo"},
    **{f"self_attn.{p}_proj.bias": (f"{p}_proj.bias", False) for p in "qkv"},
    **{f"mlp.{p}_proj.weight": (f"{p}_proj.kernel", True) for p in ("gate", "up", "down")},
}


def torch_model_from_weights(config, weights: dict[str, np.ndarray]):
    """A plain HF causal LM holding weights in our stacked layout (no HF GGUF code involved)."""
    with torch.device("meta"):   # no random init of parameters we overwrite anyway
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    state = {"model.embed_tokens.weight": weights["embed_tokens"],
             "model.norm.weight": weights["norm"]}
    for i in range(config.num_hidden_layers):
        for suffix, (ours, transposed) in HF_LAYER.items():
            if f"layers.{ours}" in weights:
                value = weights[f"layers.{ours}"][i]
                state[f"model.layers.{i}.{suffix}"] = value.T if transposed else value
    state["lm_head.weight"] = (weights["embed_tokens"] if config.tie_word_embeddings
                               else weights["lm_head"].T)
    model.to_empty(device="cpu")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers, not weights
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
                           for k, v in state.items()}, strict=False)
    model.tie_weights()
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, exactly max_new_tokens: EOS may be generated but does not stop
    it (like vLLM's ignore_eos; HF's min_new_tokens would instead forbid EOS)."""
    ids = torch.tensor([prompt_ids])
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = []      # transformers 5: None falls back to the model default
    config.do_sample = False
    config.pad_token_id = 0
    config.max_new_tokens = max_new_tokens
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


def hf_logits(model, prompt_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt_ids])).logits[0].float().numpy()

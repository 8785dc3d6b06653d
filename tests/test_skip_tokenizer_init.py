"""skip_tokenizer_init (vLLM's flag): a model directory with config.json alone runs on dummy
weights, on prompt token ids; outputs carry token ids and empty text."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxserve import LLM, SamplingParams

ENGINE_KWARGS = {"load_format": "dummy", "max_model_len": 64, "max_num_batched_tokens": 16,
                 "max_num_seqs": 4, "kv_cache_memory_bytes": 4 << 20,
                 "compilation_cache_dir": "off", "compile_in_background": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def config_only_dir(make_tiny_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("config_only")
    shutil.copy(make_tiny_model("llama") / "config.json", directory / "config.json")
    return directory


@pytest.fixture(scope="module")
def llm(config_only_dir) -> LLM:
    return LLM(str(config_only_dir), skip_tokenizer_init=True, **ENGINE_KWARGS)


def test_a_directory_without_a_tokenizer_asks_for_skip_tokenizer_init(config_only_dir):
    with pytest.raises(ValueError, match="no tokenizer.*--skip-tokenizer-init"):
        LLM(str(config_only_dir), **ENGINE_KWARGS)


def test_token_id_prompts_generate_token_ids_and_empty_text(llm):
    assert llm.get_tokenizer() is None
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, [11, 12]], GREEDY, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 5 and completion.text == ""
        assert all(entry[token].decoded_token is None
                   for token, entry in zip(completion.token_ids, completion.logprobs))
    # greedy on the same prompt gives the same ids: the engine really ran the tokens
    again = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)


def test_what_needs_a_tokenizer_fails_with_the_reason(llm, config_only_dir):
    with pytest.raises(ValueError, match="cannot pass text prompts when `skip_tokenizer_init`"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings .*skip_tokenizer_init"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=3, stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat template.*skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    vocab = json.loads((config_only_dir / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError, match=rf"out of range \[0, {vocab}\)"):   # the model's
        llm.generate([[vocab]], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()

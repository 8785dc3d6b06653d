"""One tiny model per architecture family, end to end: offline `LLM.generate` and the OpenAI
server over the same engine core give the same greedy tokens, streamed or not.

The `engine` tier's server check for every family (tests/test_server.py serves only the tiny
Llama, as a subprocess); the families' parity with Hugging Face is in test_parity.py,
test_gemma.py and test_moe.py. The server runs in this process on loopback (uvicorn), driven
by the real `openai` client; logprob tokens come back as "token_id:N", so tokens are compared
exactly, not through text.
"""

from __future__ import annotations

import openai
import pytest

from jaxserve import LLM, SamplingParams
from tests import precision
from tests.test_gemma import GEMMA2
from tests.test_moe import MIXTRAL, QWEN3_MOE
from tests.test_server_fake_engine import ServerThread

pytestmark = pytest.mark.engine

# family (jaxserve/models/<family>.py) -> (tiny config: make_tiny_model's arguments)
FAMILIES = {"llama": ("llama", {}), "gemma": GEMMA2, "mixtral": MIXTRAL,
            "qwen3_moe": QWEN3_MOE}
# Each family's engine settings as its parity test builds it (test_parity.py, test_gemma.py,
# test_moe.py): the same step programs, so the compilation cache serves both tests.
MAX_NUM_BATCHED_TOKENS = {"llama": 32, "gemma": 32, "mixtral": 8, "qwen3_moe": 8}
PROMPT = "Paged attention stores the key-value cache in fixed-size blocks"
MAX_TOKENS = 12


def _ids(tokens: list[str]) -> list[int]:
    """Token ids of logprob entries sent as "token_id:N" (--return-tokens-as-token-ids)."""
    assert all(t.startswith("token_id:") for t in tokens), tokens[:3]
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_served_completions_and_chat_give_the_offline_greedy_tokens(make_tiny_model, family):
    config_class, overrides = FAMILIES[family]
    llm = LLM(str(make_tiny_model(config_class, **overrides)), max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS[family],
              kv_cache_memory_bytes=2 << 20,
              **precision.EXACT)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [offline] = llm.generate([PROMPT], greedy, use_tqdm=False)
    messages = [{"role": "user", "content": PROMPT}]
    [offline_chat] = llm.chat(messages, greedy, use_tqdm=False)
    expected, expected_chat = list(offline.outputs[0].token_ids), \
        list(offline_chat.outputs[0].token_ids)
    assert len(expected) == len(expected_chat) == MAX_TOKENS

    srv = ServerThread(llm.llm_engine.engine_core, return_tokens_as_token_ids=True)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        common = {"model": "fake-model", "max_tokens": MAX_TOKENS, "temperature": 0.0,
                  "extra_body": {"ignore_eos": True}}
        completion = client.completions.create(prompt=PROMPT, logprobs=0, **common)
        assert _ids(completion.choices[0].logprobs.tokens) == expected
        assert completion.choices[0].text == offline.outputs[0].text
        assert completion.usage.completion_tokens == MAX_TOKENS

        streamed = [chunk.choices[0] for chunk in client.completions.create(
            prompt=PROMPT, logprobs=0, stream=True, **common) if chunk.choices]
        assert _ids([t for c in streamed if c.logprobs for t in c.logprobs.tokens]) == expected
        assert streamed[-1].finish_reason == "length"

        chat = client.chat.completions.create(messages=messages, logprobs=True, **common)
        assert _ids([entry.token for entry in chat.choices[0].logprobs.content]) == \
            expected_chat
        assert chat.choices[0].message.content == offline_chat.outputs[0].text
    finally:
        srv.stop()

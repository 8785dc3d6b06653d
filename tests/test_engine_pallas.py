"""The engine with the Pallas attention backend (interpret mode on CPU) matches the reference."""

from __future__ import annotations

from jaxserve import LLM, SamplingParams


def test_pallas_backend_greedy_outputs_equal_reference_backend(make_tiny_model):
    model = str(make_tiny_model("qwen3"))
    prompts = [[11, 23, 98, 421, 77], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                       21, 22], [300, 301]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "pallas-interpret"):
        # Few buckets: interpret mode makes every compiled shape slow.
        llm = LLM(model, attention_backend=backend, max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20)
        assert llm.llm_engine.engine_core.runner.model.backend.name.startswith(backend)
        outputs[backend] = [o.outputs[0].token_ids
                            for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["pallas-interpret"] == outputs["reference"]

"""Structured outputs (xgrammar) end to end on a tiny random Llama: every constraint kind
holds at temperature 0 and 1 in batches mixed with free requests, free requests are not
disturbed, async and sync scheduling agree, and nothing compiles after warm-up.

A random model rarely *chooses* to finish a JSON document, so the constraints are built
so that completion is reachable (enums, booleans, bounded arrays); an output cut by
max_tokens must still be a prefix the grammar accepts, and enough outputs must finish.
"""

from __future__ import annotations

import asyncio
import json
import re

import jax
import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams

PROMPTS = [[11, 23, 98, 421, 77], [310, 248, 9, 150], [42, 61, 331, 88, 12, 7], [91, 64, 5]]

PERSON_SCHEMA = {
    "$defs": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "favorite": {"$ref": "#/$defs/color"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                "required": ["kind"], "additionalProperties": False},
    },
    "required": ["ok", "favorite", "tags", "pet"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{2,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "yes" | "no" | "maybe " digit digit?\ndigit ::= [0-9]'


def _validators():
    """(StructuredOutputsParams, check(text) for a finished output) per constraint kind."""
    return {
        "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                        lambda text: isinstance(json.loads(text), dict)),
        "json": (StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True),
                 lambda text: jsonschema.validate(json.loads(text), PERSON_SCHEMA) is None),
        "regex": (StructuredOutputsParams(regex=REGEX),
                  lambda text: re.fullmatch(REGEX, text) is not None),
        "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
        "grammar": (StructuredOutputsParams(grammar=GRAMMAR),
                    lambda text: re.fullmatch(r"yes|no|maybe [0-9]{1,2}", text) is not None),
    }


@pytest.fixture(scope="module")
def llm(make_tiny_model):
    # Same settings as tests/test_engine.py's `llm`: the compilation cache is shared.
    return LLM(str(make_tiny_model("llama")), max_model_len=256, max_num_seqs=32,
               max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20)


def _accepts_prefix(llm, constraint: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """A fresh matcher accepts every token (the output is a valid, maybe unfinished prefix)."""
    import xgrammar as xgr

    compiled = llm.llm_engine.engine_core.grammars.grammar_for(constraint).result()
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids)


def _free(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constraint_holds_in_a_batch_mixed_with_free_requests(llm, temperature):
    validators = _validators()
    prompts, params, kinds = [], [], []
    for i, (kind, (constraint, _)) in enumerate(validators.items()):
        for j in range(2):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            params.append(SamplingParams(temperature=temperature, seed=10 * i + j,
                                         max_tokens=64, structured_outputs=constraint))
            kinds.append(kind)
    free_prompts = PROMPTS[:3]
    outs = llm.generate(prompts + free_prompts, params + [_free()] * 3, use_tqdm=False)
    finished = 0
    for kind, out in zip(kinds, outs):
        constraint, check = validators[kind]
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), (kind, c.finish_reason)
        if c.finish_reason == "stop":
            assert check(c.text), (kind, c.text)
            finished += 1
        else:
            assert _accepts_prefix(llm, constraint, c.token_ids), (kind, c.text)
    # Without whitespace, the schema (enums, booleans, short arrays) and the bounded kinds
    # (regex, choice, grammar) always finish within 64 tokens; json_object may not.
    assert finished >= 8, [(k, o.outputs[0].text) for k, o in zip(kinds, outs)]
    # Free requests in the same batch are exactly what they are alone.
    alone = llm.generate(free_prompts, _free(), use_tqdm=False)
    for mixed, ref in zip(outs[len(prompts):], alone):
        assert mixed.outputs[0].token_ids == ref.outputs[0].token_ids


def test_n_2_children_follow_their_own_matchers_and_stop_strings_still_apply(llm):
    choice = StructuredOutputsParams(choice=CHOICES)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(n=4, temperature=1.0, seed=3,
                                                      max_tokens=16, structured_outputs=choice),
                         use_tqdm=False)
    assert {c.text for c in out.outputs} <= set(CHOICES)
    assert all(c.finish_reason == "stop" for c in out.outputs)
    regex = StructuredOutputsParams(regex=REGEX)
    [out] = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=16, stop=["-"],
                                                      structured_outputs=regex), use_tqdm=False)
    assert out.outputs[0].text in ("cat", "dog") and out.outputs[0].stop_reason == "-"


def test_max_tokens_cuts_a_constrained_output_with_length(llm):
    schema = StructuredOutputsParams(json=PERSON_SCHEMA)
    [out] = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=3,
                                                      structured_outputs=schema), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    assert c.text.startswith("{") and _accepts_prefix(llm, schema, c.token_ids)


@pytest.mark.parametrize("bad, message", [
    (dict(json={"type": "bogus"}), "invalid structured outputs json"),
    (dict(json="{not json"), "invalid JSON schema"),
    (dict(regex="a(b"), "invalid structured outputs regex"),
    (dict(grammar="root ::= undefined_rule"), "invalid structured outputs grammar"),
])
def test_invalid_specs_fail_at_add_request_and_the_engine_keeps_serving(llm, bad, message):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**bad))
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("bad", None, params, prompt_token_ids=PROMPTS[0])
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate([PROMPTS[0]], _free(4), use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_that_fails_to_compile_ends_its_request_with_error(llm, monkeypatch):
    from types import SimpleNamespace

    def fail(grammar):
        raise RuntimeError("injected compile failure")

    monkeypatch.setattr(llm.llm_engine.engine_core.grammars, "_compiler",
                        SimpleNamespace(compile_grammar=fail))
    broken = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="never-compiled-[0-9]"))
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], [broken, _free(4)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and not outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("method", ["fill_bitmask", "accept"])
def test_one_requests_matcher_fault_ends_it_alone_without_an_engine_restart(llm, monkeypatch,
                                                                              method):
    """A matcher raising while the step's bitmask is built (fill_bitmask) or while its
    token is accepted (accept) is that request's fault: it ends with "error"; a constrained
    and a free request in the same steps finish exactly as they do alone, and the engine
    never restarts."""
    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.structured_outputs.matcher import SeqGrammar

    choice = SamplingParams(temperature=0.0, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    [ref_constrained, ref_free] = llm.generate([PROMPTS[1], PROMPTS[2]], [choice, _free(12)],
                                               use_tqdm=False)
    core = llm.llm_engine.engine_core
    original = getattr(SeqGrammar, method)
    faults = []

    def faulty(self, *args):
        victim = core.requests.states.get("victim")
        if victim is not None and self is victim.seqs[0].grammar:
            faults.append(method)
            raise RuntimeError(f"injected {method} fault")
        return original(self, *args)

    monkeypatch.setattr(SeqGrammar, method, faulty)
    engine = AsyncLLMEngine(core, start=False)

    async def scenario():
        streams = [engine.submit(rid, None, params, prompt_token_ids=prompt)
                   for rid, prompt, params in (("victim", PROMPTS[0], choice),
                                               ("constrained", PROMPTS[1], choice),
                                               ("free", PROMPTS[2], _free(12)))]
        engine.start()                    # all three are in its inbox: one first step
        await engine.wait_accepted(streams)
        return [await _final(engine, stream) for stream in streams]

    try:
        victim, constrained, free = asyncio.run(scenario())
        assert faults, "the injected fault never fired"
        assert victim.finished and victim.outputs[0].finish_reason == "error"
        for out, ref in ((constrained, ref_constrained), (free, ref_free)):
            assert (list(out.outputs[0].token_ids), out.outputs[0].finish_reason) == \
                (list(ref.outputs[0].token_ids), ref.outputs[0].finish_reason)
        assert engine.num_restarts == 0 and engine.is_healthy
        assert core.scheduler.num_constrained == 0 and core.block_manager.usage == 0.0
    finally:
        engine.shutdown()


async def _final(engine, stream):
    return [out async for out in engine.stream_outputs(stream)][-1]


def test_params_need_exactly_one_constraint_and_guided_decoding_is_an_alias():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ")
    alias = SamplingParams(guided_decoding=StructuredOutputsParams(regex="a+"))
    assert alias.structured_outputs.regex == "a+" and alias.guided_decoding is None


def _constrained_workload(engine) -> tuple[dict, list]:
    validators = _validators()
    compiles: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if "compile" in event or "trace" in event:
            compiles.append(event)

    rng = np.random.default_rng(7)
    for i in range(12):
        prompt = rng.integers(5, 500, size=int(rng.integers(3, 30))).tolist()
        kind = list(validators)[i % 6] if i % 6 < 5 else None
        constraint = validators[kind][0] if kind else None
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=40,
                                n=2 if i == 3 else 1, ignore_eos=kind is None,
                                structured_outputs=constraint)
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    finished = {}
    from jaxserve.runner.model_runner import wait_for_background_compiles

    wait_for_background_compiles()   # warm-up complete: every bucket compiled
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return finished, compiles, engine.engine_core.scheduler.num_preemptions


def test_async_and_sync_scheduling_give_identical_constrained_tokens_and_compile_nothing(
        make_tiny_model):
    """On a KV cache small enough to preempt (recompute keeps each sequence's matcher, since
    it keeps the output tokens), with grammars compiling while others run."""
    runs = {}
    for mode in (True, False):
        # Same settings as tests/test_engine.py's async test: the compilation cache is shared.
        llm = LLM(str(make_tiny_model("llama")), max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=64, num_gpu_blocks_override=14, async_scheduling=mode)
        engine = llm.llm_engine
        assert engine.engine_core.max_steps_in_flight == (2 if mode else 1)
        runs[mode] = _constrained_workload(engine)
        if mode:
            # Two steps in flight even with constrained rows: the scheduler then skips a
            # constrained row while its token is pending. Same tokens.
            engine.engine_core._max_in_flight = lambda: 2
            runs["skipping"] = _constrained_workload(engine)
    validators = _validators()
    for mode, (finished, compiles, preemptions) in runs.items():
        assert compiles == [], mode
        assert preemptions > 0, mode
        assert len(finished) == 12
        for i in range(12):
            kind = list(validators)[i % 6] if i % 6 < 5 else None
            for c in finished[f"r{i}"].outputs:
                if kind is not None and c.finish_reason == "stop":
                    assert validators[kind][1](c.text), (kind, c.text)
    for other in (runs["skipping"][0], runs[False][0]):
        a = runs[True][0]
        for request_id in a:
            for x, y in zip(a[request_id].outputs, other[request_id].outputs, strict=True):
                assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text,
                                                                   y.finish_reason), request_id


# -- the server (tests/conftest.py's `tools_server`: JSON without free whitespace) -----------------
SERVER_FORMS = {   # request fields → check(text) of a finished output
    "response_format json_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON_SCHEMA, "strict": True}}},
        lambda text: jsonschema.validate(json.loads(text), PERSON_SCHEMA) is None),
    "response_format json_object": (
        {"response_format": {"type": "json_object"}},
        lambda text: isinstance(json.loads(text), dict)),
    "guided_json": ({"guided_json": PERSON_SCHEMA},
                    lambda text: jsonschema.validate(json.loads(text), PERSON_SCHEMA) is None),
    "guided_regex": ({"guided_regex": REGEX}, lambda text: re.fullmatch(REGEX, text)),
    "guided_choice": ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    "guided_grammar": ({"guided_grammar": GRAMMAR},
                       lambda text: re.fullmatch(r"yes|no|maybe [0-9]{1,2}", text)),
    "structured_outputs": ({"structured_outputs": {"regex": REGEX}},
                           lambda text: re.fullmatch(REGEX, text)),
}


def _post(server, path: str, body: dict) -> dict:
    import httpx

    r = httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_constraints_hold_on_both_endpoints_beside_free_requests(tools_server):
    from concurrent.futures import ThreadPoolExecutor

    free = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    jobs = []
    for name, (fields, _) in SERVER_FORMS.items():
        for path, base in (("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Describe a person"}]}),
                           ("/v1/completions", {"prompt": "A person as JSON:"})):
            for temperature in (0.0, 1.0):
                jobs.append((name, path, {**base, **fields, "max_tokens": 120, "seed": 5,
                                          "n": 2, "temperature": temperature}))
    with ThreadPoolExecutor(len(jobs) + 2) as pool:      # one batch: all in flight at once
        free_future = pool.submit(_post, tools_server, "/v1/completions", free)
        results = list(pool.map(lambda job: _post(tools_server, job[1], job[2]), jobs))
        mixed_free = free_future.result()
    for (name, path, _), body in zip(jobs, results):
        check = SERVER_FORMS[name][1]
        for choice in body["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            if name == "response_format json_object" and choice["finish_reason"] == "length":
                assert text.startswith("{"), (name, path, text)    # a string ran long
                continue
            assert choice["finish_reason"] == "stop", (name, path, text)
            assert check(text), (name, path, text)
    alone = _post(tools_server, "/v1/completions", free)
    assert mixed_free["choices"][0]["text"] == alone["choices"][0]["text"]


def test_openai_client_parse_returns_a_parsed_pydantic_object(tools_server):
    from typing import Literal

    import openai
    from pydantic import BaseModel

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        vaccinated: bool

    class Person(BaseModel):
        favorite: Literal["red", "green", "blue"]
        pets: list[Pet]

    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="EMPTY", max_retries=0)
    completion = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Describe a person"}],
        response_format=Person, max_tokens=120, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert Person.model_validate_json(completion.choices[0].message.content) == parsed


@pytest.mark.parametrize("fields, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "Unsupported type"),
    ({"guided_regex": "a(b"}, "parenthesis is not closed"),
    ({"guided_grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "unknown structured_outputs field(s): jsonn"),
    ({"guided_whitespace_pattern": " *", "guided_regex": "a"}, "not supported"),
])
def test_invalid_constraints_are_openai_400s_and_the_server_keeps_serving(tools_server, fields,
                                                                          needle):
    import httpx

    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(tools_server.url + path, json={**base, **fields, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and needle in error["message"]
        assert _post(tools_server, path, {**base, "max_tokens": 2})["choices"]


def test_token_bitmask_sets_exactly_the_cleared_bits_to_minus_inf():
    import jax.numpy as jnp

    from jaxserve.runner.grammar_mask import apply_token_bitmask

    rng = np.random.default_rng(0)
    vocab = 70                                             # not a multiple of 32
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    allowed = rng.random((3, vocab)) < 0.5
    allowed[2] = True                                      # an unconstrained row
    padded = np.zeros((3, 96), bool)
    padded[:, :vocab] = allowed
    padded[2] = True
    words = (padded.reshape(3, 3, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    bitmask = words.astype(np.uint32).view(np.int32)
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(out, np.where(allowed, logits, -np.inf))
    free = np.full((3, 3), -1, np.int32)                   # nothing constrained: untouched
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(jnp.asarray(logits),
                                                                 jnp.asarray(free))), logits)


def test_a_grammar_that_finishes_compiling_while_checked_is_not_a_failure():
    """The engine looks at a compiling grammar's future once per check: one that completes
    between two looks (done() False, then True with no exception) stays a success."""
    import time
    from types import SimpleNamespace

    from jaxserve.engine.core import EngineCore

    class FinishesWhileChecked:
        looks = 0

        def done(self) -> bool:
            self.looks += 1
            return self.looks > 1

        def exception(self):
            return None

    failed = []
    engine = SimpleNamespace(
        _compiling={"req": (FinishesWhileChecked(), time.monotonic())},
        scheduler=SimpleNamespace(abort_request=lambda *a: failed.append(a)),
        requests=SimpleNamespace(finish=lambda *a: failed.append(a)))
    EngineCore._fail_unbuildable_grammars(engine)
    assert failed == [] and "req" in engine._compiling
    EngineCore._fail_unbuildable_grammars(engine)     # now done, no exception: dropped
    assert failed == [] and engine._compiling == {}

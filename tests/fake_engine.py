"""A fake LLMEngine (same surface, no JAX, no model) and a byte-level tokenizer, for tests
of the HTTP layer, the async engine and the terminal chat."""

from __future__ import annotations

import time

from jaxserve.config import EngineConfig
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams

CYCLE = "the quick brown fox jumps over the lazy dog. "
EOS = 256


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is EOS."""
    chat_template = "fake"
    eos_token_id = EOS

    def __len__(self) -> int:
        return 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids]

    def apply_chat_template(self, messages, chat_template=None, tokenize=False,
                            add_generation_prompt=True, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """LLMEngine's surface; each step appends one character of CYCLE to every sequence
    (of ``script`` instead, when set: then the sequence stops at the script's end)."""

    def __init__(self, max_model_len: int = 128, step_delay: float = 0.0) -> None:
        self.config = EngineConfig()
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.model_path = "fake-model"
        self.lora_registry = None                  # LoRA off
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.script: str | None = None

    def add_request(self, request_id, prompt, params: SamplingParams, *, prompt_token_ids=None,
                    arrival_time=None) -> None:
        ids = prompt_token_ids if prompt_token_ids is not None else \
            self.tokenizer.encode(prompt)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(ids) >= self.max_model_len:
            raise ValueError("prompt too long")
        start = sum(ids) % len(CYCLE)
        self.requests[request_id] = {
            "ids": ids, "params": params, "outs": [[] for _ in range(params.n)],
            "finish": [None] * params.n, "start": start, "changed": False,
            "metrics": RequestMetrics(arrival_time=arrival_time or time.time())}
        self.num_prompt_tokens += len(ids)

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.get(request_id)
            if state is None:
                continue
            self.aborted.append(request_id)
            state["finish"] = [f or "abort" for f in state["finish"]]
            state["changed"] = True

    def has_unfinished_requests(self) -> bool:
        # Like LLMEngine today: an aborted request's pending final output does not count,
        # though the next step() still returns it.
        return any(f is None for state in self.requests.values() for f in state["finish"])

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            raise RuntimeError("injected engine failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.time()
        outputs = []
        for request_id, state in list(self.requests.items()):
            params: SamplingParams = state["params"]
            for j, out in enumerate(state["outs"]):
                if state["finish"][j] is not None:
                    continue
                if self.script is not None:
                    out.extend(self.script[len(self.tokenizer.decode(out))].encode())
                else:
                    out.append(ord(CYCLE[(state["start"] + j + len(out)) % len(CYCLE)]))
                state["changed"] = True
                self.num_generation_tokens += 1
                m = state["metrics"]
                m.first_scheduled_time = m.first_scheduled_time or now
                m.first_token_time = m.first_token_time or now
                m.last_token_time = now
                text = self.tokenizer.decode(out)
                if any(s in text for s in params.stop) or text == self.script:
                    state["finish"][j] = "stop"
                elif len(out) >= params.max_tokens:
                    state["finish"][j] = "length"
            if state["changed"]:
                outputs.append(self._output(request_id, state, now))
        return outputs

    def _output(self, request_id, state, now) -> RequestOutput:
        state["changed"] = False
        params = state["params"]
        completions = []
        for j, out in enumerate(state["outs"]):
            text = self.tokenizer.decode(out)
            stop_reason = None
            for s in params.stop:
                if s in text:
                    text, stop_reason = text[:text.index(s)], s
            logprobs = None
            if params.logprobs is not None:
                logprobs = [{t: Logprob(-0.5, 1, chr(t)),
                             **{t2: Logprob(-1.5, 2, chr(t2)) for t2 in [ord("#")]
                                if params.logprobs >= 1}} for t in out]
            completions.append(CompletionOutput(j, text, list(out), None, logprobs,
                                                state["finish"][j], stop_reason))
        finished = all(f is not None for f in state["finish"])
        if finished:
            state["metrics"].finished_time = now
            del self.requests[request_id]
        return RequestOutput(request_id, None, state["ids"], completions, finished,
                             metrics=state["metrics"])

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(num_running=len(self.requests),
                              kv_cache_usage=min(1.0, len(self.requests) / 8),
                              num_free_blocks=64, num_blocks=64,
                              num_prompt_tokens=self.num_prompt_tokens,
                              num_generation_tokens=self.num_generation_tokens)

    def add_metrics(self, registry, model_name: str) -> None:
        pass

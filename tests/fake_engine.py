"""A fake engine core (EngineCore's interface, no JAX, no model) and a byte-level tokenizer,
for tests of the HTTP layer, the async engine and the terminal chat."""

from __future__ import annotations

import threading
import time

from jaxserve.config import EngineConfig
from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest, SeqDelta
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.outputs import RequestMetrics
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


class FakeEngineCore:
    """EngineCore's interface; each step appends one character of CYCLE to every sequence
    (of ``script`` instead, when set: then the sequence stops at the script's end). Stop
    strings, text and RequestOutputs come from the real front ends (`LLMEngine`,
    `AsyncLLMEngine`), as with EngineCore."""

    def __init__(self, max_model_len: int = 128, step_delay: float = 0.0) -> None:
        self.config = EngineConfig()
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.vocab_size = len(self.tokenizer)
        self.step_delay = step_delay
        # When set: a step with requests blocks until the test sets this event (a step that
        # runs exactly as long as the test needs, whatever the machine's speed).
        self.step_gate: threading.Event | None = None
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.finished_by_frontend: list[tuple[str, int]] = []
        self.fail_next_step = False
        self.model_path = "fake-model"
        self.lora_registry = None                  # LoRA off
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.script: str | None = None
        self.num_steps = 0
        self.first_token_step: dict[str, int] = {}     # request id -> step of its first token
        self.fault_hook = None
        self.num_recoveries = 0
        self.last_prompt_ids: list[int] = []       # what the latest request was given

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        ids, n = request.prompt_token_ids, request.params.n
        self.last_prompt_ids = list(ids)
        self.requests[request.request_id] = {
            "ids": ids, "params": request.params, "outs": [[] for _ in range(n)],
            "sent": [0] * n, "finish": [None] * n, "finish_sent": [False] * n,
            "start": sum(ids) % len(CYCLE), "changed": False,
            "metrics": RequestMetrics(arrival_time=request.arrival_time)}
        self.num_prompt_tokens += len(ids)

    def abort_request(self, request_ids) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.requests.get(request_id)
            if state is None:
                continue
            self.aborted.append(request_id)
            state["finish"] = [f or "abort" for f in state["finish"]]
            state["changed"] = True

    def finish_sequences(self, sequences) -> None:
        for request_id, index in sequences:
            state = self.requests.get(request_id)
            if state is None or state["finish"][index] is not None:
                continue
            self.finished_by_frontend.append((request_id, index))
            state["finish"][index] = "stop"
            state["changed"] = True

    def has_unfinished_requests(self) -> bool:
        return any(state["changed"] or any(f is None for f in state["finish"])
                   for state in self.requests.values())

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def unscheduled_requests(self) -> dict[str, float]:
        return {rid: state["metrics"].arrival_time for rid, state in self.requests.items()
                if state["metrics"].first_scheduled_time is None}

    def recover(self) -> None:
        self.requests.clear()
        self.num_recoveries += 1

    def step(self) -> list[EngineCoreOutput]:
        now = time.time()
        for state in self.requests.values():      # every request is in every step
            m = state["metrics"]
            m.first_scheduled_time = m.first_scheduled_time or now
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected engine failure")
        if self.fault_hook is not None:
            self.fault_hook()
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.step_gate is not None and self.requests:
            self.step_gate.wait()
        now = time.time()
        outputs = []
        self.num_steps += 1
        for request_id, state in list(self.requests.items()):
            self.first_token_step.setdefault(request_id, self.num_steps)
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
                if self.script is not None and self.tokenizer.decode(out) == self.script:
                    state["finish"][j] = "stop"
                elif len(out) >= params.max_tokens:
                    state["finish"][j] = "length"
            if state["changed"]:
                outputs.append(self._output(request_id, state, now))
        return outputs

    def _output(self, request_id, state, now) -> EngineCoreOutput:
        state["changed"] = False
        params = state["params"]
        deltas = []
        for j, out in enumerate(state["outs"]):
            new = out[state["sent"][j]:]
            if not new and (state["finish"][j] is None or state["finish_sent"][j]):
                continue
            state["sent"][j] = len(out)
            state["finish_sent"][j] = state["finish"][j] is not None
            logprobs = None
            if params.logprobs is not None:
                top = [ord("#")] if params.logprobs >= 1 else []
                logprobs = [(t, -0.5, 1, [t, *top], [-0.5, *[-1.5] * len(top)]) for t in new]
            deltas.append(SeqDelta(j, new, logprobs, state["finish"][j]))
        finished = all(f is not None for f in state["finish"])
        if finished:
            state["metrics"].finished_time = now
            del self.requests[request_id]
        return EngineCoreOutput(request_id, deltas, finished, 0, state["metrics"])

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(num_running=len(self.requests),
                              kv_cache_usage=min(1.0, len(self.requests) / 8),
                              num_free_blocks=64, num_blocks=64,
                              num_prompt_tokens=self.num_prompt_tokens,
                              num_generation_tokens=self.num_generation_tokens)

    def add_metrics(self, registry, model_name: str) -> None:
        pass

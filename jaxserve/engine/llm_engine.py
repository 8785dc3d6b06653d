"""`LLMEngine`: the front end for callers on one thread (LLM.generate, the terminal chat, tests).

vLLM's shape: an `InputProcessor` validates each request at the edge and hands the engine
core an `EngineRequest`; the core (`EngineCore`, or `DataParallelEngineCore` over replicas)
schedules, runs the model and reports token deltas; the `OutputProcessor` turns those into
RequestOutputs and says which sequences a stop string ended, which this finishes in the core.
The server's front end, `AsyncLLMEngine`, does the same around the same core and processors
with the core on its own thread. The core never calls back into a front end.

    engine = LLMEngine(EngineCore(config))
    engine.add_request("a", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step(): ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.protocol import EngineCoreInterface
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from jaxserve.engine.snapshot import EngineSnapshot


class LLMEngine:
    """Validate → engine core → text, on the caller's thread. Not thread-safe."""

    def __init__(self, engine_core: EngineCoreInterface) -> None:
        self.engine_core = engine_core
        self.config = engine_core.config
        self.tokenizer = engine_core.tokenizer       # None under skip_tokenizer_init
        self.max_model_len = engine_core.max_model_len
        self.model_path = engine_core.model_path
        self.input_processor = InputProcessor.for_core(engine_core)
        self.output_processor = OutputProcessor(engine_core.tokenizer)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, lora_request: Any = None) -> None:
        """Validate and queue a request; its outputs come from `step`. Raises ValueError
        (and changes nothing) if it can never run.

        lora_request: a LoRARequest (loaded now unless in the host LRU; a bad adapter is a
        ValueError) or an already loaded LoadedLoRA."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.input_processor.process(
            request_id, prompt, sampling_params, prompt_token_ids=prompt_token_ids,
            arrival_time=arrival_time, lora_request=lora_request)
        self.engine_core.add_request(request)
        self.output_processor.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown ids are ignored); their final outputs come from `step`."""
        self.engine_core.abort_request(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.get_num_unfinished_requests()

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step; the RequestOutputs it gives (by each request's output_kind: a
        FINAL_ONLY request's only when it finishes)."""
        processed = self.output_processor.process_outputs(self.engine_core.step())
        if processed.requests_to_abort:
            self.engine_core.abort_request(processed.requests_to_abort)
        if processed.sequences_to_finish:
            self.engine_core.finish_sequences(processed.sequences_to_finish)
        return processed.request_outputs

    # -- inspection ----------------------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """The core's gauges and counters now (jaxserve/engine/snapshot.py)."""
        return self.engine_core.snapshot()

    def prompt_logits(self, prompt_token_ids: list[int], lora_request: Any = None
                      ) -> np.ndarray:
        """Logits [len, V] of a prompt through the paged path, for parity checks (idle engine;
        under ``lora_request``'s adapter if given)."""
        return self.engine_core.prompt_logits(prompt_token_ids, lora_request)

"""The one protocol LLM, AsyncLLMEngine and the server speak to an engine.

`LLMEngine` (one replica), `DataParallelEngine` (replicas behind a router) and the
tests' fake engine all implement `SteppedEngine`; nothing probes for attributes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest
    from jaxserve.engine.snapshot import EngineSnapshot
    from jaxserve.outputs import RequestOutput
    from jaxserve.sampling_params import SamplingParams


class SteppedEngine(Protocol):
    """A stepped engine: one thread calls every method.

    The core surface (`add_core_request`, `step_core`, `finish_sequences`, `abort_request`)
    carries validated requests in and token deltas out; AsyncLLMEngine drives it and builds
    text on its asyncio side. `add_request`/`step` are the same with the front end run on the
    caller's thread (jaxserve/engine/frontend.py), for LLM and scripts.
    """

    config: EngineConfig
    tokenizer: Any
    max_model_len: int
    model_path: str
    # Tests only: called inside step(); an exception it raises is a step fault (recovery).
    fault_hook: Any

    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, **kwargs: Any) -> None:
        """Queue a request; ValueError (changing nothing) if it can never run. LLMEngine also
        takes ``lora_request`` (a LoRARequest or LoadedLoRA); callers pass it only when set,
        so engines without LoRA need not accept it."""

    def add_core_request(self, request: EngineRequest) -> None:
        """Queue a request validated at the edge; ValueError (changing nothing) if this engine
        cannot run it."""

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown ids are ignored); their final outputs come from step()."""

    def finish_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """Finish (request id, sequence index) pairs a stop string ended at the front end."""

    def step_core(self) -> list[EngineCoreOutput]:
        """Advance the engine; the new tokens of requests that changed or finished."""

    def step(self) -> list[RequestOutput]:
        """`step_core` plus the front end: RequestOutputs of requests that changed."""

    def has_unfinished_requests(self) -> bool: ...

    def unscheduled_requests(self) -> dict[str, float]:
        """Request id -> arrival time (time.time()) of unfinished requests none of whose
        sequences has been scheduled yet."""

    def recover(self) -> None:
        """After step() raised: drop every request (no outputs for them), discard the KV
        cache contents, keep weights and compiled steps; counters never go backwards."""

    def get_num_unfinished_requests(self) -> int: ...

    def snapshot(self) -> EngineSnapshot: ...

    def add_metrics(self, registry: Any, model_name: str) -> None:
        """Register engine-specific Prometheus series (per-replica ones under data
        parallelism) on ``registry``; the common ones come from `snapshot`."""

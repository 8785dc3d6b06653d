"""The one protocol LLM, AsyncLLMEngine and the server speak to an engine.

`LLMEngine` (one replica), `DataParallelEngine` (replicas behind a router) and the
tests' fake engine all implement `SteppedEngine`; nothing probes for attributes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.snapshot import EngineSnapshot
    from jaxserve.outputs import RequestOutput
    from jaxserve.sampling_params import SamplingParams


class SteppedEngine(Protocol):
    """A stepped engine: one thread calls every method."""

    config: EngineConfig
    tokenizer: Any
    max_model_len: int
    model_path: str

    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, **kwargs: Any) -> None:
        """Queue a request; ValueError (changing nothing) if it can never run. LLMEngine also
        takes ``lora_request`` (a LoRARequest or LoadedLoRA); callers pass it only when set,
        so engines without LoRA need not accept it."""

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown ids are ignored); their final outputs come from step()."""

    def step(self) -> list[RequestOutput]:
        """Advance the engine; outputs of requests that changed or finished."""

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def snapshot(self) -> EngineSnapshot: ...

    def add_metrics(self, registry: Any, model_name: str) -> None:
        """Register engine-specific Prometheus series (per-replica ones under data
        parallelism) on ``registry``; the common ones come from `snapshot`."""

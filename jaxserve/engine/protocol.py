"""The one interface both front ends (`LLMEngine`, `AsyncLLMEngine`) drive an engine core by.

`EngineCore` (one replica), `DataParallelEngineCore` (replicas behind a router) and the tests'
fake core all implement `EngineCoreInterface`; nothing probes for attributes. Validated
requests go in (`EngineRequest`), token deltas come out (`EngineCoreOutput`): text is the
front ends' (jaxserve/engine/output_processor.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest
    from jaxserve.engine.snapshot import EngineSnapshot
    from jaxserve.lora.registry import LoRARegistry


class EngineCoreInterface(Protocol):
    """An engine core: one thread calls every method."""

    config: EngineConfig
    tokenizer: Any               # None under skip_tokenizer_init
    max_model_len: int
    vocab_size: int              # the model's: bounds prompt ids when no tokenizer is loaded
    model_path: str
    lora_registry: LoRARegistry | None     # None: LoRA off
    # Tests only: called inside step(); an exception it raises is a step fault (recovery).
    fault_hook: Any

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request validated at the edge; ValueError (changing nothing) if this core
        cannot run it."""

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (unknown ids are ignored); their final outputs come from step()."""

    def finish_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """Finish (request id, sequence index) pairs a stop string ended at the front end."""

    def step(self) -> list[EngineCoreOutput]:
        """Advance the engine; the new tokens of requests that changed or finished."""

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def unscheduled_requests(self) -> dict[str, float]:
        """Request id -> arrival time (time.time()) of unfinished requests none of whose
        sequences has been scheduled yet."""

    def recover(self) -> None:
        """After step() raised: drop every request (no outputs for them), discard the KV
        cache contents, keep weights and compiled steps; counters never go backwards."""

    def snapshot(self) -> EngineSnapshot: ...

    def add_metrics(self, registry: Any, model_name: str) -> None:
        """Register core-specific Prometheus series (per-replica ones under data
        parallelism) on ``registry``; the common ones come from `snapshot`."""

    def prompt_logits(self, prompt_token_ids: list[int], lora_request: Any = None
                      ) -> np.ndarray:
        """Logits [len, V] of a prompt through the paged path (idle core), for parity checks."""

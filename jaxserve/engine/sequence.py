"""One sequence's state as the scheduler, block manager and runner see it.

A request with ``n`` completions owns ``n`` sequences (same prompt, own
outputs). Token ids are prompt followed by generated output; the KV cache
holds ``num_computed_tokens`` of them, in the blocks listed by ``block_table``.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"        # EOS, stop token or stop string
    FINISHED_LENGTH = "length"       # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


_seq_counter = itertools.count()


class Sequence:
    """Prompt + output token ids and where their KV lives."""

    __slots__ = (
        "seq_id", "request_id", "index", "token_ids", "num_prompt_tokens", "sampling_params",
        "status", "num_computed_tokens", "block_table", "num_cached_tokens", "seed",
        "arrival_time", "stop_reason", "cumulative_logprob", "logprobs", "num_preemptions",
        "block_hashes", "num_pending_tokens", "max_num_tokens", "grammar", "spec_backoff",
        "spec_skip_steps", "lora", "lora_slot",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: "SamplingParams", index: int = 0, seed: int = 0,
                 arrival_time: float = 0.0, max_num_tokens: int = 1 << 62) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index                      # which of the request's n completions
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache, or will be once the steps in flight finish
        # (the scheduler counts a step's tokens when it schedules them).
        self.num_computed_tokens = 0
        # Tokens sampled by steps in flight that the host has not seen yet (async scheduling:
        # the device feeds them to the next step itself). At most one per step in flight.
        self.num_pending_tokens = 0
        # Prompt + max_tokens, capped by max_model_len: no step is scheduled past it.
        self.max_num_tokens = max_num_tokens
        self.block_table: list[int] = []        # block ids, in position order
        self.block_hashes: list[int] = []       # hash chain of this seq's full blocks
        self.num_cached_tokens = 0              # prompt tokens served from the prefix cache
        self.seed = seed                        # sampling seed (per request, fixed at arrival)
        self.arrival_time = arrival_time
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = None
        self.num_preemptions = 0
        # Structured outputs: this sequence's matcher (a SeqGrammar), None when free.
        self.grammar: Any = None
        # Speculative decoding: after a step whose drafts were all rejected, skip drafting
        # for spec_skip_steps steps (spec_backoff doubles on each miss, resets on a hit).
        self.spec_backoff = 0
        self.spec_skip_steps = 0
        # LoRA: the adapter it runs under (a jaxserve.lora.registry.LoadedLoRA; None: the base
        # model), and the device slot it holds while running (0: none / base model).
        self.lora: Any = None
        self.lora_slot = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, "
                f"{self.status.value})")

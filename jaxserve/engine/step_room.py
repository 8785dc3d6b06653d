"""What one scheduling step has left to hand out, and how a prompt chunk that asks for
prompt logprobs is fitted into the runner's fixed-size prompt-logprobs gather."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.engine.sequence import Sequence


@dataclass(slots=True)
class StepRoom:
    """What one `schedule` call has left to hand out, shared by its two halves."""
    budget: int                      # tokens
    prompt_logprobs: int             # prompt-logprob gather slots
    prefill_limit: int | None = None  # prompt tokens the step may take in all (None: no cap)
    prefill_used: int = 0            # prompt tokens planned so far
    num_partial: int = 0             # sequences still inside their prompt after this step


def prompt_logprobs_positions(seq: Sequence, start: int, num_new: int) -> int:
    """Positions of the chunk [start, start + num_new) that give prompt logprobs: those before
    the prompt's last token (position p predicts prompt token p + 1)."""
    if seq.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_new, seq.num_prompt_tokens - 1) - start)


def fit_prompt_logprobs(seq: Sequence, start: int, num_new: int, room: int) -> int:
    """num_new, shortened so that the chunk's prompt-logprobs positions fit in ``room``."""
    if prompt_logprobs_positions(seq, start, num_new) <= room:
        return num_new
    return room

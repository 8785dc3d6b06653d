"""One prefill for the prompt of an ``n > 1`` request.

The first of a request's sequences to be admitted leads, and its siblings keep their place
in the waiting queue until the leader's prompt blocks are in the prefix cache; admitted
then, each finds every full prompt block there and computes only the tail (at most one
block, and at least the last prompt token, whose logits it samples from). Without this
every child would prefill the whole prompt in the same steps, before any of it could be
cached.
"""

from __future__ import annotations

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sequence import Sequence


class SharedPrefill:
    """The leaders of the requests whose siblings wait for a shared prompt's blocks."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        # request id -> the sibling prefilling the shared prompt for the others.
        self.leaders: dict[str, Sequence] = {}

    def _shared_prompt_blocks(self, seq: Sequence) -> int:
        """Prompt blocks a sibling of `seq` can take from the prefix cache (the last prompt
        token always runs, so at most (P - 1) // block_size)."""
        return (seq.num_prompt_tokens - 1) // self.block_manager.block_size

    def maybe_lead(self, seq: Sequence) -> None:
        """`seq` was just admitted: if siblings could share its prompt, they wait for it."""
        params = seq.sampling_params
        if (params.n > 1 and seq.num_output_tokens == 0 and params.prompt_logprobs is None
                and self.block_manager.enable_prefix_caching
                and seq.request_id not in self.leaders
                and seq.num_cached_tokens < self._shared_prompt_blocks(seq)
                * self.block_manager.block_size):
            self.leaders[seq.request_id] = seq

    def waits(self, seq: Sequence) -> bool:
        """Whether waiting `seq` should let its request's leader finish caching the prompt."""
        leader = self.leaders.get(seq.request_id)
        if leader is None or leader is seq:
            return False
        if not leader.is_finished and self.block_manager.num_registered_blocks(leader) < \
                self._shared_prompt_blocks(seq):
            return True
        del self.leaders[seq.request_id]   # cached (or the leader is gone): go
        return False

    def forget(self, seq: Sequence) -> None:
        """`seq` finished: if it led, its siblings prefill themselves."""
        if self.leaders.get(seq.request_id) is seq:
            del self.leaders[seq.request_id]

"""Draft-model proposer (vLLM's ``method: draft_model``): a small model of the same
tokenizer proposes k tokens per sequence, greedily, run by the engine's own machinery.

It has a `ModelRunner` of its own (its weights, its paged KV cache, its compiled buckets)
and a `BlockManager` of its own with prefix caching. Each proposal round admits every
candidate sequence as a fresh *mirror* sequence: its prefix-cache hit covers what earlier
rounds computed (whole blocks of the real tokens), the rest is prefilled (in chunks of the
step budget), then k - 1 decode steps run, each feeding the previous step's token on the
device (no host round trip between them). Only the real tokens' blocks are registered;
the mirrors are freed at once, so their blocks stay cached for the next round. So a round
costs one prefill step of about a block per row plus k - 1 single-token steps.

The drafts are the draft model's argmax, a point-mass proposal: the verification's
acceptance rule (jaxserve/runner/rejection_sampler.py) keeps the target's output
distribution exact for sampled requests too; their acceptance is p(draft), which for a
draft that agrees with the target's mode is what min(1, p/q) gives a greedy draft.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.sequence import Sequence
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_contract import NewSeqData, SchedulerOutput


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager,
                 num_speculative_tokens: int, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.k = num_speculative_tokens
        self.budget = max_num_batched_tokens
        self._greedy = SamplingParams(temperature=0.0, max_tokens=num_speculative_tokens)
        self._finished: list[int] = []          # last round's mirrors: rows to drop

    def reset(self) -> None:
        """Forget every mirror and the draft cache (the engine recovers from a failed step)."""
        blocks = self.block_manager
        self.block_manager = BlockManager(blocks.num_blocks, blocks.block_size,
                                          blocks.enable_prefix_caching)
        self.runner.reset()
        self._finished = []

    def propose(self, histories: Seq[Seq[int]], max_drafts: Seq[int]) -> list[list[int]]:
        """Per sequence, up to min(k, max_drafts[i]) greedy draft tokens."""
        mirrors: list[tuple[int, Sequence, int]] = []       # (index, mirror, drafts wanted)
        for i, (history, limit) in enumerate(zip(histories, max_drafts)):
            wanted = min(self.k, limit)
            if wanted <= 0:
                continue
            mirror = Sequence("draft", list(history), self._greedy)
            blocks, num_cached = self.block_manager.get_computed_blocks(mirror)
            # Room for the history and the first wanted - 1 drafts (the last is not fed).
            if not self.block_manager.allocate_slots(
                    mirror, len(history) - num_cached + wanted - 1, blocks):
                continue               # the draft cache is full: no drafts for this one
            mirrors.append((i, mirror, wanted))
        drafts: list[list[int]] = [[] for _ in histories]
        if not mirrors:
            return drafts
        pending = self._dispatch(mirrors)
        by_seq = {mirror.seq_id: i for i, mirror, _ in mirrors}
        for out, step in pending:
            result = step.result()
            for row, seq_id in enumerate(out.seq_ids):
                if out.is_sampling[row]:
                    drafts[by_seq[seq_id]].append(result.sampled_token_ids[row])
        for _, mirror, _ in mirrors:
            mirror.num_computed_tokens = mirror.num_tokens   # register the real tokens only
            self.block_manager.cache_full_blocks(mirror)
            self.block_manager.free(mirror)
        self._finished = [mirror.seq_id for _, mirror, _ in mirrors]
        return drafts

    def _dispatch(self, mirrors: list[tuple[int, Sequence, int]]) -> list:
        """Prefill every mirror (chunked to the budget), then k - 1 decodes; all dispatched
        before any is collected."""
        pending = []
        new = [NewSeqData(m.seq_id, list(m.token_ids), m.num_tokens, list(m.block_table),
                          m.num_computed_tokens, self._greedy, 0) for _, m, _ in mirrors]
        computed = {m.seq_id: m.num_computed_tokens for _, m, _ in mirrors}
        first = True
        while first or any(computed[m.seq_id] < m.num_tokens for _, m, _ in mirrors):
            out = SchedulerOutput(new_seqs=new if first else [],
                                  finished_seq_ids=self._finished if first else [])
            room = self.budget
            for _, m, _ in mirrors:
                todo = m.num_tokens - computed[m.seq_id]
                if todo <= 0 or room <= 0:
                    continue
                count = min(todo, room)
                self._plan(out, m.seq_id, count, computed, sampling=count == todo)
                room -= count
            out.total_num_scheduled_tokens = self.budget - room
            pending.append((out, self.runner.execute(out)))
            first = False
        for j in range(1, max(wanted for _, _, wanted in mirrors)):
            out = SchedulerOutput()
            for _, m, wanted in mirrors:
                if j < wanted:
                    self._plan(out, m.seq_id, 1, computed, sampling=True)
            out.total_num_scheduled_tokens = out.num_decode_tokens = out.num_rows
            pending.append((out, self.runner.execute(out)))
        return pending

    @staticmethod
    def _plan(out: SchedulerOutput, seq_id: int, count: int, computed: dict[int, int],
              sampling: bool) -> None:
        out.seq_ids.append(seq_id)
        out.num_scheduled_tokens.append(count)
        out.num_computed_tokens.append(computed[seq_id])
        out.is_sampling.append(sampling)
        computed[seq_id] += count

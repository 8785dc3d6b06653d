"""Continuous batching: which sequences run this step, and how many tokens each.

All scheduled tokens share one flat token axis, so a step mixes decodes (one
token), chunks of long prompts (chunked prefill) and newly admitted prompts
under one token budget. When the KV cache runs out, the newest running
sequence is preempted by recompute: its blocks are freed and it goes back to
the front of the waiting queue, to be recomputed (prompt + output so far) when
it is admitted again; the prefix cache often makes that cheap.

A step's tokens count as computed when they are *scheduled* (vLLM v1), so the
next step can be scheduled while this one still runs (async scheduling). A
step that ends at a sequence's newest token samples a token the host learns
one step later: until then it is *pending* (``seq.num_pending_tokens``), and
the next step's decode feeds it from the device. `update_from_output` appends
the sampled tokens when they arrive.

A request that asks for prompt logprobs has its prompt chunks capped so that the step's
prompt positions fit the runner's fixed-size prompt-logprobs gather
(``max_prompt_logprobs_per_step``), and it skips prefix-cache hits (as vLLM does): a cached
position would have no logits to give.

A request with ``n > 1`` prefills its shared prompt once (shared_prefill.py).

Structured outputs: a sequence whose grammar is still compiling is passed over in the
waiting queue (keeping its place), and a constrained sequence is not scheduled while it
has a pending token, since its next grammar bitmask depends on that token.

While decodes run, prefill work per step is capped (``long_prefill_token_threshold``,
``max_num_partial_prefills``, and the decode-aware budget below), so one long
prompt cannot stall every stream's next token.

Multi-LoRA: a sequence under an adapter is admitted only when its adapter has a device
slot or one is free (jaxserve/lora/slots.py: at most ``max_loras`` distinct adapters
run at once); otherwise it is passed over, keeping its place, like a compiling grammar.

The scheduler knows sequences and blocks, never tensors: it speaks to the
runner only through `SchedulerOutput` (jaxserve/step_contract.py).
"""

from __future__ import annotations

import logging
from collections import deque

from jaxserve.config import SchedulerConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.micro_batches import MicroBatches
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.engine.shared_prefill import SharedPrefill
from jaxserve.engine.step_costs import StepCosts, auto_step_tokens
from jaxserve.engine.step_room import StepRoom, fit_prompt_logprobs, prompt_logprobs_positions
from jaxserve.lora.slots import LoRASlots
from jaxserve.step_contract import NewSeqData, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    """Waiting queue (FIFO) and running list; ``schedule`` then ``update_from_output``."""

    # `schedule` and `update_from_output` inline their per-sequence common case (a plain
    # decode); tests turn this off to prove the general path gives the same outputs
    # (tests/test_scheduler_fast_paths.py).
    inline_fast_paths = True

    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager,
                 max_model_len: int, max_loras: int = 0) -> None:
        """max_loras: device slots for LoRA adapters (0: LoRA off)."""
        budget = scheduler_config.max_num_batched_tokens
        if budget is None or budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget} "
                             "(resolve the config first: Platform.resolve_config)")
        if not scheduler_config.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when chunked prefill is disabled, or long prompts could never be scheduled")
        capacity = block_manager.num_blocks * block_manager.block_size
        if capacity < max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                f"({max_model_len}); a single sequence could never finish")
        self.max_num_seqs = scheduler_config.max_num_seqs
        # The RUNNING cap (--max-num-active-seqs): at most this many sequences hold KV blocks
        # and decode; the rest wait. Independent of max_num_seqs, which sizes the batch.
        self.max_num_active_seqs = min(scheduler_config.max_num_active_seqs or
                                       self.max_num_seqs, self.max_num_seqs)
        self.num_held_by_active_cap = 0   # waiting sequences the cap kept out, last schedule
        self.max_num_batched_tokens = budget
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold or 0
        self.max_num_partial_prefills = scheduler_config.max_num_partial_prefills
        self.decode_prefill_budget = scheduler_config.prefill_budget_while_decoding
        self.max_prompt_logprobs_per_step = scheduler_config.max_prompt_logprobs_per_step or 0
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []   # in admission order; the last is the newest
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence, by id
        self._finished_ids: list[int] = []    # rows the runner should drop next step
        self._rolled_back: dict[int, int] = {}  # seq id -> block table length after rollback
        self.shared_prefill = SharedPrefill(block_manager)   # n > 1: one prefill per prompt
        self.num_preemptions = 0
        self.num_constrained = 0              # unfinished sequences with a grammar
        self.lora_slots = LoRASlots(max_loras) if max_loras else None
        # Measured step times, fed by the engine (EngineCore._collect); None: the auto prefill
        # cap falls back to its token rule.
        self.step_costs: StepCosts | None = None
        # Pipeline parallel: micro-batches in flight (engine/micro_batches.py); None: off.
        self.micro_batches: MicroBatches | None = None

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def get_seq(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def add_seq(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, seq
        assert seq.num_tokens <= self.max_model_len, (seq.num_tokens, self.max_model_len)
        self._waiting.append(seq)
        self._seqs[seq.seq_id] = seq
        self.num_constrained += seq.grammar is not None

    # ------------------------------------------------------------------- step
    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their KV blocks.

        drafts: seq id -> proposed tokens (speculative decoding; see `draft_candidates`).
        A decode with drafts schedules its newest token plus as many drafts as the token
        budget and the sequence's length limit allow; its KV slots are allocated for all of
        them and `update_from_output` rolls back the rejected ones.
        """
        out = SchedulerOutput(finished_seq_ids=self._finished_ids,
                              block_table_lengths=self._rolled_back)
        self._finished_ids = []
        self._rolled_back = {}
        # Decodes this step (running sequences past their prompt): the decode-aware prefill
        # cap needs the count before any prefill chunk is planned, and the waiting prompts
        # (the auto cap weighs the rows they will add: see _prefill_limit).
        num_decodes = sum(1 for seq in self._running
                          if seq.num_computed_tokens >= seq.num_prompt_tokens)
        room = StepRoom(budget=self.max_num_batched_tokens,
                         prompt_logprobs=self.max_prompt_logprobs_per_step,
                         prefill_limit=self._prefill_limit(num_decodes, len(self._waiting)))
        self._schedule_running(out, drafts or {}, room)
        if not out.preempted_seq_ids:   # admit waiting ones unless the cache was just short
            self._admit_waiting(out, room)
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - room.budget
        if self.micro_batches is not None:
            out.micro_batch = self.micro_batches.current
            self.micro_batches.advance()
        return out

    def _schedule_running(self, out: SchedulerOutput, drafts: dict[int, list[int]],
                          room: StepRoom) -> None:
        """Plan the running sequences: decodes and the next chunks of unfinished prefills."""
        running = self._running
        budget = room.budget        # a local in the per-sequence loop, written back below
        block_size = self.block_manager.block_size
        seq_ids, num_scheduled = out.seq_ids, out.num_scheduled_tokens
        num_computed, is_sampling = out.num_computed_tokens, out.is_sampling
        fast = self.inline_fast_paths
        micro = self.micro_batches
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if micro is not None and micro.skips(seq.seq_id):
                i += 1               # another micro-batch's: its own step schedules it
                continue
            computed = seq.num_computed_tokens
            pending = seq.num_pending_tokens
            num_tokens = len(seq.token_ids) + pending
            num_new = num_tokens - computed
            if (fast and num_new == 1 and seq.grammar is None
                    and computed < len(seq.block_table) * block_size
                    and not (pending and num_tokens >= seq.max_num_tokens)
                    and (not drafts or seq.seq_id not in drafts)):
                # The common case, inlined (this loop runs once per sequence per step): a
                # plain decode whose slot is in a block it already has. What the general path
                # below does for it, without its calls: a one-token chunk has no prompt
                # logprob positions, allocate_slots has nothing to allocate, _plan samples.
                seq_ids.append(seq.seq_id)
                num_scheduled.append(1)
                num_computed.append(computed)
                is_sampling.append(True)
                seq.num_computed_tokens = computed + 1
                seq.num_pending_tokens = pending + 1
                out.num_decode_tokens += 1
                budget -= 1
                i += 1
                continue
            if num_new == 0 or (seq.num_pending_tokens
                                and seq.num_tokens_with_pending >= seq.max_num_tokens):
                # Nothing to do, or its pending token is its last: the step in flight ends it.
                i += 1
                continue
            if seq.grammar is not None and seq.num_pending_tokens:
                # Its next bitmask needs the token still in flight: wait one step.
                i += 1
                continue
            is_prefill = num_new > 1
            proposed = drafts.get(seq.seq_id)
            if proposed and not is_prefill and not seq.num_pending_tokens:
                # Drafts fit the budget (the newest token first) and the length limit: the
                # step emits at most one token more than it accepts.
                draft_room = min(budget - 1, seq.max_num_tokens - seq.num_tokens - 1)
                proposed = proposed[:max(0, draft_room)]
                num_new += len(proposed)
            else:
                proposed = None
            if is_prefill:
                num_new = min(num_new, self._chunk_cap(room))
            num_new = fit_prompt_logprobs(seq, seq.num_computed_tokens,
                                           min(num_new, budget), room.prompt_logprobs)
            if num_new <= 0:
                i += 1
                continue
            room.prompt_logprobs -= prompt_logprobs_positions(seq, seq.num_computed_tokens,
                                                               num_new)
            if not self._allocate_running(seq, num_new, out, len(proposed or ())):
                continue              # seq preempted itself; running[i] is now past the end
            if proposed:
                out.draft_token_ids[seq.seq_id] = list(proposed)
            budget -= num_new
            if is_prefill:
                room.prefill_used += num_new
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    room.num_partial += 1
            else:
                out.num_decode_tokens += 1
            i += 1
        room.budget = budget

    def _admit_waiting(self, out: SchedulerOutput, room: StepRoom) -> None:
        """Admit waiting sequences in FIFO order while the budget, the batch and the cache
        allow. Passed over this step, keeping their place: grammar not compiled yet, no LoRA
        slot for them, or a sibling still prefilling the shared prompt."""
        running = self._running
        passed_over: list[Sequence] = []
        # A preempted sequence re-enters at the front of the queue, so under the active cap
        # the requests that already had KV (and a stream started) are re-admitted first.
        cap = self.max_num_active_seqs
        micro = self.micro_batches
        while self._waiting and room.budget > 0 and len(running) < cap and \
                (micro is None or micro.has_room(running)):
            seq = self._waiting[0]
            if seq.num_pending_tokens:
                break   # preempted while a step ran: wait for that step's token
            if (seq.grammar is not None and not seq.grammar.is_ready) or \
                    self.shared_prefill.waits(seq):
                passed_over.append(self._waiting.popleft())
                continue
            chunk = min(room.budget, self._chunk_cap(room))
            if chunk <= 0:
                break
            computed_blocks, num_cached = [], 0
            if seq.sampling_params.prompt_logprobs is None:
                computed_blocks, num_cached = self.block_manager.get_computed_blocks(seq)
            num_remaining = seq.num_tokens - num_cached
            num_new = fit_prompt_logprobs(seq, num_cached, min(num_remaining, chunk),
                                           room.prompt_logprobs)
            if num_new <= 0:
                break
            if num_new < num_remaining and (not self.enable_chunked_prefill or
                                            room.num_partial >= self.max_num_partial_prefills):
                break
            if seq.lora is not None and not self.acquire_lora(seq, out):
                passed_over.append(self._waiting.popleft())
                continue
            if not self.block_manager.allocate_slots(seq, num_new, computed_blocks):
                self._release_lora(seq)
                break  # head-of-line blocking keeps admission FIFO-fair
            self._waiting.popleft()
            room.prompt_logprobs -= prompt_logprobs_positions(seq, num_cached, num_new)
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            if micro is not None:
                micro.admit(seq.seq_id)
            out.new_seqs.append(NewSeqData(
                seq.seq_id, list(seq.token_ids), seq.num_prompt_tokens,
                list(seq.block_table), seq.num_computed_tokens, seq.sampling_params, seq.seed,
                seq.lora_slot))
            self._plan(seq, num_new, out)
            self.shared_prefill.maybe_lead(seq)
            room.budget -= num_new
            room.prefill_used += num_new
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                room.num_partial += 1
        self._waiting.extendleft(reversed(passed_over))
        self.num_held_by_active_cap = len(self._waiting) if len(running) >= cap and \
            cap < self.max_num_seqs else 0

    def acquire_lora(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Give seq its adapter's slot (telling the runner to write it if it is new there);
        False when all max_loras slots serve other running adapters."""
        if self.lora_slots is None:
            raise ValueError("a LoRA request reached an engine without enable_lora")
        got = self.lora_slots.acquire(seq.lora.key)
        if got is None:
            return False
        seq.lora_slot, needs_write = got
        if needs_write:
            out.lora_loads[seq.lora_slot] = seq.lora.weights
        return True

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = 0

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting sequences (metrics)."""
        running = sorted({s.lora.name for s in self._running if s.lora is not None})
        waiting = sorted({s.lora.name for s in self._waiting if s.lora is not None})
        return running, waiting

    def _prefill_limit(self, num_decodes: int, num_waiting: int) -> int | None:
        """Most prompt tokens this step may prefill in all while decodes run (None: no such
        limit): ``prefill_budget_while_decoding``, by default a bound on the step's measured
        *time* (step_costs.py: at most 2.5 decode steps of the rows that will run). Once per
        step: decodes and waiting prompts are counted before anything is planned."""
        if not (self.enable_chunked_prefill and num_decodes and self.decode_prefill_budget != 0):
            return None
        if not num_waiting and num_decodes == len(self._running):
            return None     # a decode-only step: no prompt to cap (and no cost lookups)
        if self.decode_prefill_budget is not None:
            return self.decode_prefill_budget
        return auto_step_tokens(self.step_costs, num_decodes, num_waiting, self.max_num_seqs,
                                self.max_num_batched_tokens) - num_decodes

    def _chunk_cap(self, room: StepRoom) -> int:
        """Most prompt tokens the next sequence may take this step (<= 0: none): vLLM's
        per-request ``long_prefill_token_threshold``, and what is left of the step's prefill
        limit. Without chunked prefill a prompt must fit whole, so only the step's token
        budget applies."""
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        cap = self.long_prefill_token_threshold or self.max_num_batched_tokens
        if room.prefill_limit is not None:
            cap = min(cap, room.prefill_limit - room.prefill_used)
        return cap

    def _allocate_running(self, seq: Sequence, num_new: int, out: SchedulerOutput,
                          num_drafts: int = 0) -> bool:
        """Allocate blocks for a running seq's next tokens, preempting the newest running
        sequences (never an earlier one: they are already planned) until they fit."""
        num_blocks_before = len(seq.block_table)
        while not self.block_manager.allocate_slots(seq, num_new):
            victim = self._running.pop()
            self._preempt(victim, out)
            if victim is seq:
                return False
        if len(seq.block_table) > num_blocks_before:
            out.new_block_ids[seq.seq_id] = seq.block_table[num_blocks_before:]
        self._plan(seq, num_new, out, num_drafts)
        return True

    @staticmethod
    def _plan(seq: Sequence, num_new: int, out: SchedulerOutput, num_drafts: int = 0) -> None:
        """Add seq's row to the step and count its tokens as computed (drafts included:
        `update_from_output` rolls back the rejected ones)."""
        out.seq_ids.append(seq.seq_id)
        out.num_scheduled_tokens.append(num_new)
        out.num_computed_tokens.append(seq.num_computed_tokens)
        seq.num_computed_tokens += num_new
        sampling = seq.num_computed_tokens - num_drafts == seq.num_tokens_with_pending
        out.is_sampling.append(sampling)
        if sampling:
            seq.num_pending_tokens += 1

    def may_draft(self, max_batch_size: int) -> bool:
        """Whether the next step has at most ``max_batch_size`` rows, whatever is admitted."""
        return len(self._running) + min(len(self._waiting), self.max_num_seqs
                                        - len(self._running)) <= max_batch_size

    def draft_candidates(self, max_batch_size: int) -> list[Sequence]:
        """Running decodes that may be given drafts this step: none while more than
        ``max_batch_size`` sequences could run (a bigger step is compute-bound: verifying
        drafts costs more than it saves); otherwise those with no token in flight (drafts
        continue from the newest token), no grammar (its mask at a draft position would
        depend on the drafts before it), past min_tokens (whose EOS bans change within the
        drafts), and no backoff running (see `update_from_output`)."""
        if not self.may_draft(max_batch_size):
            return []
        candidates = []
        for seq in self._running:
            if seq.spec_skip_steps:
                seq.spec_skip_steps -= 1
                continue
            if (not seq.num_pending_tokens and seq.grammar is None
                    and seq.num_computed_tokens == seq.num_tokens - 1
                    and seq.num_output_tokens >= seq.sampling_params.min_tokens
                    and seq.num_tokens + 1 < seq.max_num_tokens):
                candidates.append(seq)
        return candidates

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: list[int],
                           emitted_token_ids: list[list[int]] | None = None
                           ) -> list[tuple[int, Sequence]]:
        """A step finished: append each sampling row's token; register newly full blocks.

        With speculative decoding, ``emitted_token_ids[row]`` are the tokens a row emitted
        (accepted drafts, then one more); the first is appended here like any sample, the
        rest by the caller after each one's stop checks. A row with drafts gives back the
        KV slots of its rejected drafts (`BlockManager.rollback`): they never reach the
        prefix cache. A row whose drafts were all rejected stops drafting for a while
        (doubling up to 16 steps), so text the proposer cannot predict costs little.

        Returns (row, seq) for every sequence that received a token (running, or preempted
        while the step ran: its sample is still valid). Rows of sequences finished or
        aborted since the step was scheduled are dropped here: at most that one token is
        thrown away, never emitted.
        """
        received = []
        seqs = self._seqs
        all_drafts = out.draft_token_ids
        is_sampling = out.is_sampling
        running = SequenceStatus.RUNNING
        cache_full_blocks = self.block_manager.cache_full_blocks
        block_size = self.block_manager.block_size
        num_registered = self.block_manager.num_registered.get \
            if self.block_manager.enable_prefix_caching else None
        fast = self.inline_fast_paths and not all_drafts
        for row, seq_id in enumerate(out.seq_ids):
            seq = seqs.get(seq_id)
            if seq is None:
                continue                        # finished meanwhile
            if fast and is_sampling[row] and seq.status is running \
                    and seq.max_num_tokens > seq.num_prompt_tokens:
                # The common case, inlined: a sampled token for a running sequence.
                seq.num_pending_tokens -= 1
                token_ids = seq.token_ids
                token_ids.append(sampled_token_ids[row])
                received.append((row, seq))
                if num_registered is not None and min(seq.num_computed_tokens, len(token_ids)) \
                        // block_size > num_registered(seq_id, 0):
                    cache_full_blocks(seq)      # a block filled up
                continue
            drafts = all_drafts.get(seq_id)
            if drafts and emitted_token_ids is not None:
                num_accepted = len(emitted_token_ids[row]) - 1
                seq.num_computed_tokens -= len(drafts) - num_accepted
                if seq.status == SequenceStatus.RUNNING:
                    num_blocks = len(seq.block_table)
                    self.block_manager.rollback(seq)
                    if len(seq.block_table) < num_blocks:
                        self._rolled_back[seq_id] = len(seq.block_table)
                if num_accepted:
                    seq.spec_backoff = 0
                else:
                    seq.spec_backoff = min(16, 2 * seq.spec_backoff or 1)
                    seq.spec_skip_steps = seq.spec_backoff
            if out.is_sampling[row]:
                seq.num_pending_tokens -= 1
                if seq.max_num_tokens > seq.num_prompt_tokens:   # max_tokens=0: prefill only
                    seq.token_ids.append(sampled_token_ids[row])
                received.append((row, seq))
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq)
        return received

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free ``seq``'s blocks and requeue it at the front, to be recomputed."""
        self.block_manager.free(seq)
        self._release_lora(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self._waiting.appendleft(seq)
        if self.micro_batches is not None:
            self.micro_batches.forget(seq.seq_id)
        self.num_preemptions += 1
        out.preempted_seq_ids.append(seq.seq_id)
        logger.debug("preempted %r (KV cache full; %d free blocks)", seq,
                     self.block_manager.num_free_blocks)

    # ------------------------------------------------------------ finishing
    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark ``seq`` finished, free its blocks and drop it from the queues. Idempotent."""
        assert status.is_finished, status
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.RUNNING:
            self._running.remove(seq)
            self._finished_ids.append(seq.seq_id)   # the runner holds a row for it
            self._release_lora(seq)
        else:
            self._waiting.remove(seq)
        seq.status = status
        self.block_manager.free(seq)
        del self._seqs[seq.seq_id]
        self.shared_prefill.forget(seq)
        if self.micro_batches is not None:
            self.micro_batches.forget(seq.seq_id)
        self.num_constrained -= seq.grammar is not None

    def abort_request(self, request_id: str,
                      status: SequenceStatus = SequenceStatus.FINISHED_ABORTED) -> list[Sequence]:
        """Finish every sequence of ``request_id`` (aborted, or ``status``), waiting or running."""
        seqs = [seq for seq in (*self._running, *self._waiting) if seq.request_id == request_id]
        for seq in seqs:
            self.finish_seq(seq, status)
        return seqs

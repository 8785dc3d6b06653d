"""The engine core: add requests, step (schedule → dispatch → collect), report token deltas.

One `step()` on a screen, with async scheduling (two steps in flight):

    out = scheduler.schedule()             # step N+1, while step N still runs
    pending = runner.execute(out)          # diffs applied, inputs packed, dispatched
    result = oldest_in_flight.result()     # step N's samples (the device already has them)
    scheduler.update_from_output(...)      # append tokens, register full blocks
    token-level finishing                  # EOS / stop tokens / max_tokens, while N+1 runs

`step()` returns each changed request's new tokens (`EngineCoreOutput`): the core never
touches text. Its front ends -- `LLMEngine` (LLM.generate, one thread) and `AsyncLLMEngine`
(the server) -- validate requests on the way in (`InputProcessor`) and build text on the way
out (`OutputProcessor`); they call the core, never the reverse.

Without async scheduling the same loop keeps one step in flight: it collects each step
before scheduling the next, so both modes run the same code and give the same tokens.
While a structured-output (grammar-constrained) sequence lives, the loop runs one step
in flight too: its next bitmask needs the token of the step before.

Speculative decoding (jaxserve/spec_decode): drafts continue from a sequence's newest
token, so they are proposed only when no step is in flight, and a step with drafts is
collected before the next is scheduled (its rows' accepted counts decide where they
resume). While the proposer keeps finding nothing, the loop returns to two steps in flight
and asks it again every few steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.core_requests import CoreRequests
from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest
from jaxserve.engine.micro_batches import MicroBatches
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import SequenceStatus
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.step_costs import StepCosts
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_contract import SchedulerOutput
from jaxserve.structured_outputs.bitmask import grammar_bitmask
from jaxserve.structured_outputs.compiler import COMPILE_TIMEOUT_S
from jaxserve.structured_outputs.matcher import SeqGrammar

if TYPE_CHECKING:
    from jaxserve.structured_outputs.compiler import GrammarService

logger = logging.getLogger(__name__)

# Speculative decoding: after a proposal that found nothing, run this many steps with two in
# flight (drafts need one) before proposing again.
_STEPS_BETWEEN_IDLE_PROPOSALS = 4


class EngineCore:
    """One replica's engine core (an `EngineCoreInterface`). Not thread-safe: one thread
    calls it."""

    def __init__(self, config: EngineConfig, *, log_stats: bool | None = None,
                 mesh: Any = None) -> None:
        """mesh: this replica's (1, tp) sub-mesh under data parallelism (jaxserve/parallel)."""
        from jaxserve.engine.model_setup import setup_model

        self.setup = setup_model(config, mesh)       # loads weights, sizes the cache, warms up
        self.config = self.setup.config      # resolved for the platform and model, read-only
        s = self.setup
        self.tokenizer = s.tokenizer
        self.max_model_len = s.max_model_len
        self.model_path = s.model_path
        self.lora_registry = s.lora_registry    # None: LoRA off
        self.runner = s.runner
        # What steps cost on this machine (the scheduler's auto prefill cap): kept across
        # recover(), which rebuilds the scheduler.
        self.step_costs = StepCosts()
        self._build_request_state()
        self.stats = EngineStats()
        if log_stats is None:
            log_stats = not config.runner_config.disable_log_stats
        self.log_stats = log_stats
        self.max_steps_in_flight = 2 if config.scheduler_config.async_scheduling else 1
        if self.scheduler.micro_batches is not None:    # one step in flight per micro-batch
            self.max_steps_in_flight = self.scheduler.micro_batches.count
        self._in_flight: deque[tuple[SchedulerOutput, Any, float]] = deque()
        self.vocab_size = s.runner.arch.vocab_size          # logits width: the bitmask's V
        self._grammars: GrammarService | None = None        # built on the first constrained request
        self._compiling: dict[str, tuple[Future, float]] = {}   # request id → (grammar, since)
        self.spec = config.spec_decode                       # None: speculation off
        self._proposer = None
        if self.spec is not None:
            from jaxserve.spec_decode.ngram import NgramProposer

            self._proposer = s.draft_proposer or NgramProposer(
                self.spec.num_speculative_tokens, self.spec.prompt_lookup_min,
                self.spec.prompt_lookup_max)
            self.stats.enable_spec_decode(self.spec.num_speculative_tokens)
        self._drafting = True          # the last proposal found drafts (or none was made)
        self._steps_until_proposal = 0
        # Tests only: called inside step() after a dispatch, so an exception it raises is a
        # step fault with steps in flight (jaxserve/engine/fault_injection.py). None: off.
        self.fault_hook: Callable[[], None] | None = None

    def _build_request_state(self) -> None:
        """A fresh block manager, scheduler and request table: no request, empty cache."""
        s, config = self.setup, self.config
        self.block_manager = BlockManager(s.kv_plan.num_blocks, s.kv_plan.block_size,
                                          config.cache_config.enable_prefix_caching)
        lc = config.lora_config
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager, s.max_model_len,
                                   max_loras=lc.max_loras if lc.enable_lora else 0)
        self.scheduler.step_costs = self.step_costs
        micro = self.runner.num_micro_batches                 # > 1: pipeline parallel
        if micro > 1 and config.scheduler_config.async_scheduling:
            self.scheduler.micro_batches = MicroBatches(micro,
                                                        config.scheduler_config.max_num_seqs)
        self.requests = CoreRequests(s.eos_token_ids, s.max_model_len,
                                     s.default_sampling_overrides, seed=config.model_config.seed)

    def recover(self) -> None:
        """Rebuild after a failed step: every request is dropped (their outputs are never
        returned; the caller fails or re-adds them), the KV cache is zeroed, the weights and
        compiled steps stay. Prometheus counters (stats, prefix-cache and preemption totals)
        carry over, so they never go backwards."""
        blocks, scheduler = self.block_manager, self.scheduler
        self._in_flight.clear()
        self._compiling.clear()
        self._build_request_state()
        self.block_manager.prefix_cache_queries = blocks.prefix_cache_queries
        self.block_manager.prefix_cache_hits = blocks.prefix_cache_hits
        self.scheduler.num_preemptions = scheduler.num_preemptions
        self.runner.reset()
        if self._proposer is not None:      # a draft model has its own rows and cache
            self._proposer.reset()
        self._drafting = True
        self._steps_until_proposal = 0

    def unscheduled_requests(self) -> dict[str, float]:
        """Request id -> arrival time of every unfinished request none of whose sequences
        has been scheduled yet (still queued: recovery re-runs them, queue timeouts end them)."""
        return {request_id: state.metrics.arrival_time
                for request_id, state in self.requests.states.items()
                if state.metrics.first_scheduled_time is None and not state.finished}

    @property
    def grammars(self) -> GrammarService:
        """Grammar compilation for structured outputs (xgrammar), created when first needed."""
        if self._grammars is None:
            from jaxserve.structured_outputs.compiler import GrammarService

            if self.tokenizer is None:
                raise ValueError("structured outputs compile grammars over the tokenizer's "
                                 "vocabulary, and `skip_tokenizer_init` is True")

            self._grammars = GrammarService(self.tokenizer, self.vocab_size,
                                            self.setup.eos_token_ids)
        return self._grammars

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a validated request (`InputProcessor`); ValueError (changing nothing) if this
        engine cannot run it (its sampling needs, grammar or LoRA adapter).

        request.lora_request: a LoRARequest (loaded now unless in the host LRU; a bad adapter
        is a ValueError) or an already loaded LoadedLoRA (the server loads off this thread)."""
        params = request.params
        self.runner.batch.check(params)
        lora = self._resolve_lora(request.lora_request)
        compiled = None
        if params.structured_outputs is not None:   # parsed now (ValueError), compiled async
            constraint = params.structured_outputs
            if self.config.structured_outputs_config.structured_outputs_disable_any_whitespace:
                constraint = dataclasses.replace(constraint, disable_any_whitespace=True)
            compiled = self.grammars.grammar_for(constraint)
        seqs = self.requests.new_request(request)
        for seq in seqs:
            seq.lora = lora
            if compiled is not None:
                seq.grammar = SeqGrammar(   # one matcher per sequence (n > 1)
                    compiled, params.structured_outputs.reasoning_end_token_id)
            self.scheduler.add_seq(seq)
        if compiled is not None:
            self._compiling[request.request_id] = (compiled, time.monotonic())

    def _resolve_lora(self, lora_request: Any) -> Any:
        from jaxserve.lora.registry import LoadedLoRA

        if lora_request is None or isinstance(lora_request, LoadedLoRA):
            return lora_request
        if self.lora_registry is None:
            raise ValueError(f"request names LoRA adapter {lora_request.lora_name!r}, but this "
                             "engine was started without enable_lora")
        return self.lora_registry.get(lora_request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            self.scheduler.abort_request(request_id)
            self.requests.finish(request_id, None, "abort")

    def finish_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """Finish (request id, sequence index) pairs that a stop string ended at the front
        end: their KV blocks are freed now; their final output comes from the next step."""
        for request_id, index in sequences:
            state = self.requests.states.get(request_id)
            if state is None:
                continue
            self.scheduler.finish_seq(state.seqs[index], SequenceStatus.FINISHED_STOPPED)
            self.requests.finish(request_id, index, "stop")

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self._in_flight)
                or self.requests.has_pending_outputs())

    def get_num_unfinished_requests(self) -> int:
        return self.requests.num_unfinished

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Dispatch the next step (if there is room in flight) and collect the oldest one when
        the pipeline is full; returns the new tokens of requests that changed (or finished)."""
        dispatched = False
        if self._compiling:
            self._fail_unbuildable_grammars()
        max_in_flight = self._max_in_flight()
        if len(self._in_flight) < max_in_flight and self.scheduler.has_unfinished():
            out = self.scheduler.schedule(self._propose())
            # Marked before anything can fail: a request whose data breaks this step counts
            # as scheduled, so recovery fails it rather than re-queueing it forever.
            now = time.time()
            for new in out.new_seqs:
                self.requests.mark_scheduled(self.scheduler.get_seq(new.seq_id), now)
            matcher_faults: dict[int, Exception] = {}
            if self._grammars is not None:
                out.grammar_bitmask, matcher_faults = grammar_bitmask(
                    out, self.scheduler.get_seq, self.vocab_size)
            pending = self.runner.execute(out)      # applies the diffs even with no tokens
            # Ended after the dispatch, as a client abort with a step in flight: their rows'
            # tokens are dropped when the step is collected.
            for seq_id, exc in matcher_faults.items():
                self._fail_seq(seq_id, exc)
            if pending is not None:
                self._in_flight.append((out, pending, time.perf_counter()))
                dispatched = True
                if self.fault_hook is not None:
                    self.fault_hook()
        if self._in_flight and (len(self._in_flight) >= max_in_flight or not dispatched):
            self._collect(*self._in_flight.popleft())
        if self.log_stats:
            self.stats.maybe_log(self.snapshot())
        return self.requests.drain()

    def _fail_unbuildable_grammars(self) -> None:
        """A grammar that failed to compile (rare: add_request already parsed it), or is still
        compiling after COMPILE_TIMEOUT_S, ends its request with finish_reason "error"; the
        engine keeps serving."""
        now = time.monotonic()
        for request_id, (future, started) in list(self._compiling.items()):
            # One look at the future: it may finish between two (then a success read as
            # a failure ended the request with "grammar compilation failed: None").
            done = future.done()
            if done and future.exception() is None:
                del self._compiling[request_id]
                continue
            if done:
                error = future.exception()
            elif now - started > COMPILE_TIMEOUT_S:
                error = f"still compiling after {COMPILE_TIMEOUT_S:.0f} s"
            else:
                continue
            del self._compiling[request_id]
            logger.error("request %s: grammar compilation failed: %s", request_id, error)
            self.scheduler.abort_request(request_id, SequenceStatus.FINISHED_ERROR)
            self.requests.finish(request_id, None, "error")

    def _max_in_flight(self) -> int:
        """Steps to keep in flight now. A constrained row's next bitmask needs the token in
        flight, so while a constrained sequence lives, one: every row still advances every
        step (with two, the scheduler skips such rows every other step: half their speed)."""
        if self.scheduler.num_constrained:
            return 1
        if self.spec is not None and (self._drafting or self._steps_until_proposal == 0) \
                and self.scheduler.may_draft(self.spec.disable_by_batch_size):
            return 1   # a batch too big to draft for keeps two in flight
        return self.max_steps_in_flight

    def _propose(self) -> dict[int, list[int]]:
        """Drafts for this step (seq id -> tokens): only with no step in flight, since drafts
        continue from each sequence's newest token."""
        if self.spec is None:
            return {}
        if self._in_flight:
            self._steps_until_proposal = max(0, self._steps_until_proposal - 1)
            return {}
        seqs = self.scheduler.draft_candidates(self.spec.disable_by_batch_size)
        proposals = self._proposer.propose(
            [seq.token_ids for seq in seqs],
            [seq.max_num_tokens - seq.num_tokens - 1 for seq in seqs])
        drafts = {seq.seq_id: tokens for seq, tokens in zip(seqs, proposals) if tokens}
        self._drafting = bool(drafts)
        if not drafts:
            self._steps_until_proposal = _STEPS_BETWEEN_IDLE_PROPOSALS
        return drafts

    def _collect(self, out: SchedulerOutput, pending: Any, dispatch_time: float) -> None:
        """Wait for a dispatched step; append its tokens and run output processing."""
        result = pending.result()
        self.step_costs.record_result(pending.num_tokens, dispatch_time, time.perf_counter())
        now = time.time()
        for row, chunk in result.prompt_logprobs.items():   # before the tokens: a request
            seq = self.scheduler.get_seq(out.seq_ids[row])   # may finish with its prompt
            if seq is not None:
                try:
                    self.requests.process_prompt_logprobs(seq, chunk)
                except Exception as exc:   # this request's data failed: it alone ends
                    self._finish_seq(seq, self.requests.fail(seq, exc))
        emitted = result.emitted_token_ids
        received = self.scheduler.update_from_output(out, result.sampled_token_ids, emitted)
        stride = result.logprobs_stride
        num_generated = 0
        for row, seq in received:
            if seq.is_finished:            # a sibling's failure ended its request
                continue
            try:
                status = self.requests.process_token(seq, result, row * stride, now)
                num_generated += 1
                # Accepted drafts: one at a time, each through the stop checks (EOS, a stop
                # string or max_tokens inside the drafts ends the sequence there).
                for j, token in enumerate(emitted[row][1:] if emitted else (), start=1):
                    if status is not None:
                        break
                    seq.token_ids.append(token)
                    status = self.requests.process_token(seq, result, row * stride + j, now)
                    num_generated += 1
            except Exception as exc:   # this request's data failed: it alone ends
                status = self.requests.fail(seq, exc)
            if status is not None:
                self._finish_seq(seq, status)
        if out.draft_token_ids and emitted is not None:
            self.stats.record_drafts(out, emitted)
        self.stats.record_step(
            num_prompt_tokens=out.total_num_scheduled_tokens - out.num_decode_tokens
            - sum(map(len, out.draft_token_ids.values())),
            num_generation_tokens=num_generated, num_preempted=len(out.preempted_seq_ids),
            dispatch_time=dispatch_time, collect_time=time.perf_counter())

    def _fail_seq(self, seq_id: int, exc: Exception) -> None:
        """End a sequence's request with finish_reason "error" (its own data raised)."""
        seq = self.scheduler.get_seq(seq_id)
        if seq is not None and not seq.is_finished:
            self._finish_seq(seq, self.requests.fail(seq, exc))

    def _finish_seq(self, seq: Any, status: SequenceStatus) -> None:
        """A failed sequence ends its whole request (every sibling); others end alone."""
        if status is SequenceStatus.FINISHED_ERROR:
            self.scheduler.abort_request(seq.request_id, status)
        else:
            self.scheduler.finish_seq(seq, status)

    def snapshot(self) -> EngineSnapshot:
        scheduler, blocks, stats = self.scheduler, self.block_manager, self.stats
        return EngineSnapshot(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            kv_cache_usage=blocks.usage, num_free_blocks=blocks.num_free_blocks,
            num_blocks=blocks.num_blocks, prefix_cache_queries=blocks.prefix_cache_queries,
            prefix_cache_hits=blocks.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            max_num_active_seqs=scheduler.max_num_active_seqs,
            num_held_by_active_cap=scheduler.num_held_by_active_cap,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_generation_tokens=stats.num_generation_tokens, num_steps=stats.num_steps,
            spec_decode_num_drafts=stats.spec_num_drafts,
            spec_decode_num_draft_tokens=stats.spec_num_draft_tokens,
            spec_decode_num_accepted_tokens=stats.spec_num_accepted_tokens,
            spec_decode_accepted_per_pos=tuple(stats.spec_accepted_per_pos),
            **self._lora_snapshot())

    def _lora_snapshot(self) -> dict[str, Any]:
        if self.lora_registry is None:
            return {}
        running, waiting = self.scheduler.lora_adapters()
        return {"max_lora": self.config.lora_config.max_loras,
                "running_lora_adapters": tuple(running),
                "waiting_lora_adapters": tuple(waiting)}

    def add_metrics(self, registry: Any, model_name: str) -> None:
        """One replica has no series beyond the snapshot's."""

    # -- inspection ----------------------------------------------------------------------------
    def prompt_logits(self, prompt_token_ids: list[int], lora_request: Any = None
                      ) -> np.ndarray:
        """Logits [len, V] of a prompt through the paged path (under ``lora_request``'s adapter
        if given), for parity checks (idle engine)."""
        from jaxserve.engine.sequence import Sequence

        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logits needs an idle engine")
        seq = Sequence("__prompt_logits__", prompt_token_ids, SamplingParams())
        seq.lora = self._resolve_lora(lora_request)
        if not self.block_manager.allocate_slots(seq, seq.num_tokens):
            raise RuntimeError("not enough free KV blocks for prompt_logits")
        out = SchedulerOutput()
        try:
            if seq.lora is not None and not self.scheduler.acquire_lora(seq, out):
                raise RuntimeError("no free LoRA slot for prompt_logits")
            for slot, weights in out.lora_loads.items():
                self.runner.lora.write(slot, weights)
            return self.runner.prompt_logits(prompt_token_ids, seq.block_table, seq.lora_slot)
        finally:
            self.scheduler._release_lora(seq)
            self.block_manager.free(seq)

"""The engine core's requests: their sequences, when each is done, and what is new.

The scheduler decides who runs; this module decides when a sequence finishes on token
grounds (EOS, stop token, max_tokens, max_model_len, a completed structured-output
grammar, whose matcher advances here with each token) and reports each changed request
as an `EngineCoreOutput`: the tokens (and numeric logprobs) new since its last report.
Nothing here builds text or grows with a request's length: detokenization, stop strings
and logprob token text run on the front end's side (`OutputProcessor`,
jaxserve/engine/output_processor.py), which asks the core to finish a sequence whose text
matched a stop string (`EngineCore.finish_sequences`).

A request reports every step it changes when its front end needs the tokens as they come
(streaming, or stop strings to watch); a FINAL_ONLY request without stop strings reports
once, when it finishes, with all its tokens.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest, RawLogprobs, SeqDelta
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.outputs import RequestMetrics
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.step_contract import PromptLogprobsChunk, RunnerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    reports_each_step: bool                 # else only the final report
    stop_token_ids: frozenset
    finish_reasons: list[str | None]
    sent_tokens: list[int]                  # output tokens earlier reports carried, per seq
    finish_sent: list[bool]                 # an earlier report carried its finish_reason
    finished: bool = False
    # numeric prompt logprobs: [None, entry of prompt token 1, ...]; None if not asked
    prompt_logprobs: list[RawLogprobs | None] | None = None
    num_prompt_logprobs_missing: int = 0    # entries no step has filled yet
    prompt_logprobs_sent: bool = False


class CoreRequests:
    """Every unfinished request of one engine core, by id (`states`), and the reports owed."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int,
                 default_overrides: dict, seed: int = 0) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.default_overrides = default_overrides
        self._rng = random.Random(seed)
        self.states: dict[str, RequestState] = {}
        # Requests with news for the next `drain` (changed since the last one), in order.
        self._changed: dict[str, RequestState] = {}

    @property
    def num_unfinished(self) -> int:
        return sum(not r.finished for r in self.states.values())

    def has_pending_outputs(self) -> bool:
        """True while some request has an output not yet returned by `drain` (an abort's)."""
        return bool(self._changed)

    # -- admission -----------------------------------------------------------------------------
    def new_request(self, request: EngineRequest) -> list[Sequence]:
        """The request's n sequences (validated at the edge: `InputProcessor`)."""
        request_id, params = request.request_id, request.params
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.default_overrides:
            params = params.clone()
            params.update_from_generation_config(self.default_overrides)
        prompt_token_ids = request.prompt_token_ids
        max_num_tokens = self.max_model_len if params.max_tokens is None else min(
            self.max_model_len, len(prompt_token_ids) + params.max_tokens)
        seqs = []
        for i in range(params.n):
            if params.seed is not None:
                seed = params.seed if i == 0 else hash((params.seed, i)) & 0x7FFFFFFF
            else:
                seed = self._rng.getrandbits(31)
            seq = Sequence(request_id, prompt_token_ids, params, index=i, seed=seed,
                           arrival_time=request.arrival_time, max_num_tokens=max_num_tokens)
            if params.logprobs is not None:
                seq.logprobs = []
            seqs.append(seq)
        state = self.states[request_id] = RequestState(
            request_id, params, seqs, RequestMetrics(arrival_time=request.arrival_time),
            reports_each_step=bool(params.output_kind != RequestOutputKind.FINAL_ONLY
                                   or params.stop),
            stop_token_ids=frozenset(params.stop_token_ids or ()),
            finish_reasons=[None] * params.n, sent_tokens=[0] * params.n,
            finish_sent=[False] * params.n)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
            state.num_prompt_logprobs_missing = len(prompt_token_ids) - 1
        return seqs

    # -- per step ------------------------------------------------------------------------------
    def mark_scheduled(self, seq: Sequence, now: float) -> None:
        metrics = self.states[seq.request_id].metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now

    def process_prompt_logprobs(self, seq: Sequence, chunk: PromptLogprobsChunk) -> None:
        """Store a step's prompt logprobs of ``seq``'s request. A recomputed position (n > 1,
        preemption) overwrites its entry with the same values."""
        state = self.states.get(seq.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        num_top = state.params.prompt_logprobs
        entries = state.prompt_logprobs
        top_ids, top_lps = chunk.top_token_ids[:, :num_top], chunk.top_logprobs[:, :num_top]
        for i in range(len(chunk.token_ids)):
            position = chunk.first + i
            if entries[position] is None:
                state.num_prompt_logprobs_missing -= 1
            entries[position] = (int(chunk.token_ids[i]), float(chunk.logprobs[i]),
                                 int(chunk.ranks[i]), top_ids[i].tolist(), top_lps[i].tolist())
        if state.num_prompt_logprobs_missing == 0:
            self._changed[seq.request_id] = state

    def process_token(self, seq: Sequence, result: RunnerOutput, row: int, now: float
                      ) -> SequenceStatus | None:
        """seq just received the token of logprobs row ``row`` (already appended to it):
        logprobs and the token-level stop checks. Returns a finish status, or None.

        Once per sequence per step on the engine's critical path: O(1) (plus O(top-N) when
        logprobs were asked), whatever the sequence's length."""
        state = self.states[seq.request_id]
        params = state.params
        if state.reports_each_step:
            self._changed[seq.request_id] = state
        if params.max_tokens == 0:     # prefill only (prompt logprobs): the sample is dropped
            return self._finish(state, seq, SequenceStatus.FINISHED_LENGTH, now)
        token = seq.token_ids[-1]
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if seq.logprobs is not None:
            logprobs, num_top = result.logprobs, params.logprobs
            logprob = float(logprobs.sampled_logprobs[row])
            seq.cumulative_logprob += logprob
            seq.logprobs.append((token, logprob, int(logprobs.sampled_ranks[row]),
                                 logprobs.top_token_ids[row, :num_top].tolist(),
                                 logprobs.top_logprobs[row, :num_top].tolist()))
        status = self._check_stop(seq, state, token)
        if status is not None:
            self._finish(state, seq, status, now)
        return status

    def fail(self, seq: Sequence, exc: BaseException) -> SequenceStatus:
        """End ``seq``'s request with finish_reason "error" after its own output processing
        (logprobs, grammar, stop checks) raised: the engine and every other request go on.
        Returns the status to finish ``seq`` with in the scheduler."""
        logger.error("request %s failed in output processing: %r", seq.request_id, exc,
                     exc_info=exc)
        self.finish(seq.request_id, None, "error")
        return SequenceStatus.FINISHED_ERROR

    def _check_stop(self, seq: Sequence, state: RequestState, token: int
                    ) -> SequenceStatus | None:
        params = state.params
        grammar = seq.grammar
        if grammar is not None and not grammar.accept(token):
            # The bitmask allowed only grammatical tokens, so this is a bug, not bad input.
            logger.error("request %s: token %d violates its structured-output grammar",
                         seq.request_id, token)
            return SequenceStatus.FINISHED_ERROR
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens > params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED
            if token in state.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if grammar is not None and grammar.is_terminated:
            return SequenceStatus.FINISHED_STOPPED      # the structured output is complete
        if num_tokens >= seq.max_num_tokens:    # max_tokens or max_model_len, whichever first
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, state: RequestState, seq: Sequence, status: SequenceStatus, now: float
                ) -> SequenceStatus:
        """Record a sequence's finish (the scheduler sets seq.status as it frees)."""
        if state.finish_reasons[seq.index] is None:
            state.finish_reasons[seq.index] = status.value
        self._changed[seq.request_id] = state
        if all(reason is not None for reason in state.finish_reasons):
            state.finished = True
            state.metrics.finished_time = now
        return status

    # -- results -------------------------------------------------------------------------------
    def finish(self, request_id: str, index: int | None, reason: str) -> None:
        """Finish sequence ``index`` of the request (every unfinished one: None) now, with
        finish_reason ``reason`` ("abort", "error", or "stop" for a front end's stop string).
        """
        state = self.states.get(request_id)
        if state is None or state.finished:
            return
        for i, current in enumerate(state.finish_reasons):
            if current is None and (index is None or i == index):
                state.finish_reasons[i] = reason
        self._changed[request_id] = state
        if all(reason is not None for reason in state.finish_reasons):
            state.finished = True
            state.metrics.finished_time = time.time()

    def drain(self) -> list[EngineCoreOutput]:
        """The news of every request that changed since the last drain."""
        outputs = []
        changed, self._changed = self._changed, {}
        for request_id, state in changed.items():
            outputs.append(self._make_output(state))
            if state.finished:
                del self.states[request_id]
        return outputs

    def _make_output(self, state: RequestState) -> EngineCoreOutput:
        deltas = []
        seqs = state.seqs
        for seq in seqs:
            index = seq.index
            first, reason = state.sent_tokens[index], state.finish_reasons[index]
            token_ids = seq.token_ids
            num_output = len(token_ids) - seq.num_prompt_tokens
            if num_output == first and (reason is None or state.finish_sent[index]):
                continue                      # nothing new for this one
            state.sent_tokens[index] = num_output
            state.finish_sent[index] = reason is not None
            logprobs = seq.logprobs
            deltas.append(SeqDelta(
                index, token_ids[seq.num_prompt_tokens + first:],
                logprobs[first:] if logprobs is not None else None, reason,
                seq.stop_reason if isinstance(seq.stop_reason, int) else None))
        prompt_logprobs = None
        if state.prompt_logprobs is not None and state.num_prompt_logprobs_missing == 0 \
                and not state.prompt_logprobs_sent:
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        num_cached = seqs[0].num_cached_tokens if len(seqs) == 1 else max(
            s.num_cached_tokens for s in seqs)
        return EngineCoreOutput(state.request_id, deltas, state.finished, num_cached,
                                state.metrics, prompt_logprobs)

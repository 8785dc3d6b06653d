"""Host side of a request: validation, sampled tokens → text, stop checks, RequestOutputs.

The scheduler decides who runs; this module decides when a sequence is done
(EOS, stop token, stop string, max_tokens, max_model_len, a completed
structured-output grammar, whose matcher advances here with each token) and what the client
sees (incrementally detokenized text that never shows half a character or the
beginning of a stop string that is about to match).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.step_contract import PromptLogprobsChunk, RunnerOutput

logger = logging.getLogger(__name__)


@dataclass
class _SeqText:
    detok: IncrementalDetokenizer | None
    text: str = ""                 # full detokenized output (truncated at a matched stop string)
    finish_reason: str | None = None
    sent_tokens: int = 0           # DELTA outputs: what earlier outputs already carried
    sent_chars: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    texts: list[_SeqText]
    metrics: RequestMetrics
    finished: bool = False
    stops: StopChecker = field(default_factory=StopChecker)   # stop strings and hold-back
    stop_token_ids: frozenset = field(default_factory=frozenset)
    # vLLM's prompt_logprobs: [None, entry of prompt token 1, ...]; None if not asked.
    prompt_logprobs: PromptLogprobs | None = None
    num_prompt_logprobs_missing: int = 0     # entries no step has filled yet
    prompt_logprobs_sent: bool = False       # DELTA outputs carry them once


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int,
                 max_logprobs: int, default_overrides: dict[str, Any], seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.default_overrides = default_overrides
        self._rng = random.Random(seed)
        self.requests: dict[str, RequestState] = {}
        # Requests with an output for the next `drain` (changed since the last one), in order.
        self._changed: dict[str, RequestState] = {}

    @property
    def num_unfinished(self) -> int:
        return sum(not r.finished for r in self.requests.values())

    def has_pending_outputs(self) -> bool:
        """True while some request has an output not yet returned by `drain` (an abort's)."""
        return bool(self._changed)

    # -- admission -----------------------------------------------------------------------------
    def new_request(self, request_id: str, prompt: str | list[int] | None,
                    prompt_token_ids: list[int] | None, params: SamplingParams,
                    arrival_time: float) -> list[Sequence]:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, list):
            prompt, prompt_token_ids = None, prompt
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                f"model length of {self.max_model_len}. Make sure that `max_model_len` is no "
                "smaller than the number of text tokens plus one generated token.")
        if self.default_overrides:
            params = params.clone()
            params.update_from_generation_config(self.default_overrides)
        params.verify(self.max_logprobs, self.max_model_len)

        seqs, texts = [], []
        for i in range(params.n):
            if params.seed is not None:
                seed = params.seed if i == 0 else hash((params.seed, i)) & 0x7FFFFFFF
            else:
                seed = self._rng.getrandbits(31)
            max_num_tokens = self.max_model_len if params.max_tokens is None else min(
                self.max_model_len, len(prompt_token_ids) + params.max_tokens)
            seq = Sequence(request_id, prompt_token_ids, params, index=i, seed=seed,
                           arrival_time=arrival_time, max_num_tokens=max_num_tokens)
            if params.logprobs is not None:
                seq.logprobs = []
            seqs.append(seq)
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens)
            texts.append(_SeqText(detok))
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, seqs, texts,
            RequestMetrics(arrival_time=arrival_time),
            stops=StopChecker(params.stop, params.include_stop_str_in_output),
            stop_token_ids=frozenset(params.stop_token_ids or ()))
        if params.prompt_logprobs is not None:
            state = self.requests[request_id]
            state.prompt_logprobs = [None] * len(prompt_token_ids)
            state.num_prompt_logprobs_missing = len(prompt_token_ids) - 1
        return seqs

    # -- per step ------------------------------------------------------------------------------
    def mark_scheduled(self, seq: Sequence, now: float) -> None:
        metrics = self.requests[seq.request_id].metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now

    def process_prompt_logprobs(self, seq: Sequence, chunk: PromptLogprobsChunk) -> None:
        """Store a step's prompt logprobs of ``seq``'s request. A recomputed position (n > 1,
        preemption) overwrites its entry with the same values."""
        state = self.requests.get(seq.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        num_top = state.params.prompt_logprobs
        entries = state.prompt_logprobs
        for i in range(len(chunk.token_ids)):
            position = chunk.first + i
            if entries[position] is None:
                state.num_prompt_logprobs_missing -= 1
            entries[position] = self._logprob_entry(
                int(chunk.token_ids[i]), float(chunk.logprobs[i]), int(chunk.ranks[i]),
                chunk.top_token_ids[i][:num_top], chunk.top_logprobs[i][:num_top])

    def process_tokens(self, received: list[tuple[int, Sequence]], result: RunnerOutput,
                       now: float) -> list[tuple[Sequence, SequenceStatus]]:
        """`process_token` for each (row, seq) that received one token this step; returns the
        sequences that finish, with their status.

        The engine's hottest host loop (once per running sequence per step), so the common
        case -- no logprobs, no grammar, the detokenizer's byte path -- is `process_token`
        and `_check_stop` inlined, with the same checks in the same order; anything else
        takes `process_token` itself."""
        finished = []
        requests = self.requests
        eos_token_ids = self.eos_token_ids
        stopped, length = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
        for row, seq in received:
            state = requests[seq.request_id]
            params = state.params
            if seq.logprobs is not None or seq.grammar is not None or params.max_tokens == 0:
                status = self.process_token(seq, result, row, now)
                if status is not None:
                    finished.append((seq, status))
                continue
            if params.output_kind is not RequestOutputKind.FINAL_ONLY:
                self._changed[seq.request_id] = state   # (FINAL_ONLY: only when it finishes)
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            token_ids = seq.token_ids
            token = token_ids[-1]
            text = state.texts[seq.index]
            detok = text.detok
            delta = ""
            if detok is not None:
                delta = detok.step_token(token)
                if delta:
                    text.text += delta
            num_tokens = len(token_ids)
            status = None
            if num_tokens - seq.num_prompt_tokens > params.min_tokens:
                if token in eos_token_ids and not params.ignore_eos:
                    status = stopped
                elif token in state.stop_token_ids:
                    seq.stop_reason = token
                    status = stopped
                elif delta and params.stop and state.stops.may_complete(delta):
                    match = state.stops.check(text.text, len(delta))
                    if match is not None:
                        seq.stop_reason, text.text = match
                        status = stopped
            if status is None and num_tokens >= seq.max_num_tokens:
                status = length
            if status is not None:
                self._changed[seq.request_id] = state
                self._finish(state, text, status, now)
                finished.append((seq, status))
        return finished

    def process_token(self, seq: Sequence, result: RunnerOutput, row: int, now: float
                      ) -> SequenceStatus | None:
        """seq just received the token of batch row ``row`` (already appended to it): text,
        logprobs and stop checks. Returns a finish status, or None.

        This runs once per sequence per step on the engine's critical path: keep it lean."""
        state = self.requests[seq.request_id]
        params = state.params
        self._changed[seq.request_id] = state
        if params.max_tokens == 0:     # prefill only (prompt logprobs): the sample is dropped
            return self._finish(state, state.texts[seq.index], SequenceStatus.FINISHED_LENGTH,
                                now)
        token = seq.token_ids[-1]
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if seq.logprobs is not None:
            logprobs = result.logprobs
            seq.cumulative_logprob += float(logprobs.sampled_logprobs[row])
            seq.logprobs.append(self._logprob_entry(
                token, float(logprobs.sampled_logprobs[row]), int(logprobs.sampled_ranks[row]),
                logprobs.top_token_ids[row][:params.logprobs],
                logprobs.top_logprobs[row][:params.logprobs]))

        text = state.texts[seq.index]
        detok = text.detok
        num_new_chars = 0
        if detok is not None:
            delta = detok.step_token(token)
            if delta:
                text.text += delta
                num_new_chars = len(delta)
        status = self._check_stop(seq, state, text, token, num_new_chars)
        if status is not None:
            self._finish(state, text, status, now)
        return status

    @staticmethod
    def _finish(state: RequestState, text: _SeqText, status: SequenceStatus, now: float
                ) -> SequenceStatus:
        text.finish_reason = status.value      # the scheduler sets seq.status as it frees
        if all(t.finish_reason is not None for t in state.texts):
            state.finished = True
            state.metrics.finished_time = now
        return status

    def _check_stop(self, seq: Sequence, state: RequestState, text: _SeqText, token: int,
                    num_new_chars: int) -> SequenceStatus | None:
        params = state.params
        grammar = seq.grammar
        if grammar is not None and not grammar.accept(token):
            # The bitmask allowed only grammatical tokens, so this is a bug, not bad input.
            logger.error("request %s: token %d violates its structured-output grammar",
                         seq.request_id, token)
            return SequenceStatus.FINISHED_ERROR
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output > params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED
            if token in state.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if grammar is not None and grammar.is_terminated:
            return SequenceStatus.FINISHED_STOPPED      # the structured output is complete
        if num_output > params.min_tokens and num_new_chars and params.stop \
                and text.detok is not None:
            match = state.stops.check(text.text, num_new_chars)
            if match is not None:
                seq.stop_reason, text.text = match
                return SequenceStatus.FINISHED_STOPPED
        if num_tokens >= seq.max_num_tokens:    # max_tokens or max_model_len, whichever first
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _logprob_entry(self, token: int, logprob: float, rank: int, top_ids, top_logprobs
                       ) -> dict[int, Logprob]:
        """vLLM's entry: the actual token first (with its vocab rank), then the top-N by rank."""
        entry: dict[int, Logprob] = {token: Logprob(logprob, rank, self._decode_one(token))}
        for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
            tid = int(tid)
            if tid not in entry:
                entry[tid] = Logprob(float(lp), r, self._decode_one(tid))
        return entry

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    # -- results -------------------------------------------------------------------------------
    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Finish the request now; unfinished completions get finish_reason ``reason``."""
        state = self.requests.get(request_id)
        if state is None or state.finished:
            return
        for text in state.texts:
            if text.finish_reason is None:
                text.finish_reason = reason
        state.finished = True
        self._changed[request_id] = state
        state.metrics.finished_time = time.time()

    def drain(self) -> list[RequestOutput]:
        """RequestOutputs (cumulative, like vLLM) of every request that changed since last time."""
        outputs = []
        changed, self._changed = self._changed, {}
        for request_id, state in changed.items():
            if state.finished or state.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._make_output(state))
            if state.finished:
                del self.requests[request_id]
        return outputs

    def _make_output(self, state: RequestState) -> RequestOutput:
        delta = state.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for seq, text in zip(state.seqs, state.texts):
            visible = text.text
            if text.finish_reason is None and state.stops.holdback:
                visible = visible[:max(0, len(visible) - state.stops.holdback)]
            first, logprobs = 0, seq.logprobs
            if delta:   # only what earlier outputs did not carry
                visible, text.sent_chars = visible[text.sent_chars:], len(visible)
                first, text.sent_tokens = text.sent_tokens, seq.num_output_tokens
                logprobs = logprobs[first:] if logprobs is not None else None
            completions.append(CompletionOutput(
                index=seq.index, text=visible,
                token_ids=seq.token_ids[seq.num_prompt_tokens + first:],
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=text.finish_reason, stop_reason=seq.stop_reason))
        prompt_logprobs = None
        if state.prompt_logprobs is not None and state.num_prompt_logprobs_missing == 0 \
                and not (delta and state.prompt_logprobs_sent):
            # Shared, not copied (each cumulative output would copy the whole prompt's):
            # complete entries change no more (a recompute rewrites the same values).
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions,
            finished=state.finished,
            num_cached_tokens=max(s.num_cached_tokens for s in state.seqs),
            metrics=state.metrics, prompt_logprobs=prompt_logprobs)

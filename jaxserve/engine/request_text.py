"""The front end's side of a request's outputs: token deltas → text, stop strings, RequestOutputs.

One request's state in vLLM v1's OutputProcessor (jaxserve/engine/output_processor.py). It
runs where the request's consumer runs (the asyncio side of AsyncLLMEngine, or the caller
of LLMEngine.step), never on the engine thread: the engine core reports token ids and
numeric logprobs (`EngineCoreOutput`), and this builds, once, the text (incremental
detokenization), the stop-string matches and the logprobs' token text. A stop string ends a
sequence here; the caller then tells the core to finish it (`EngineCore.finish_sequences`)
so its KV blocks are freed.

Per new token the cost is O(1) plus, when the token's text may complete a stop string,
a `str.find` over the last ``max(len(stop)) - 1`` characters and the new text: text is
kept as a list of pieces with their end offsets, never re-copied as it grows. What each
RequestOutput carries follows SamplingParams.output_kind: DELTA (what is new since the
last output), CUMULATIVE (everything so far: O(length) per output, for callers who ask)
or FINAL_ONLY (one output when the request finishes).
"""

from __future__ import annotations

import bisect
from typing import Any

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker
from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest, RawLogprobs, SeqDelta
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import RequestOutputKind


class TokenTexts:
    """id -> ``tokenizer.decode([id])`` (a logprob entry's token text), computed once per id
    and shared by every request of one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:     # skip_tokenizer_init: vLLM's decoded_token None
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def entry(self, raw: RawLogprobs) -> dict[int, Logprob]:
        """vLLM's entry: the actual token first (with its vocab rank), then the top-N by rank."""
        token, logprob, rank, top_ids, top_logprobs = raw
        entry = {token: Logprob(logprob, rank, self(token))}
        for r, (tid, lp) in enumerate(zip(top_ids, top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, r, self(tid))
        return entry


class SeqText:
    """One sequence's text (pieces and their end offsets), tokens and logprobs so far."""

    __slots__ = ("cumulative_logprob", "detok", "ends", "finish_reason", "index", "logprobs",
                 "pieces", "sent_chars", "sent_tokens", "stop_reason", "token_ids")

    def __init__(self, index: int, detok: IncrementalDetokenizer | None, logprobs: bool) -> None:
        self.index = index
        self.detok = detok
        self.pieces: list[str] = []
        self.ends: list[int] = []           # ends[i]: characters through pieces[i]
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if logprobs else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent_chars = 0                 # DELTA: what earlier outputs carried
        self.sent_tokens = 0

    @property
    def num_chars(self) -> int:
        return self.ends[-1] if self.ends else 0

    def append(self, text: str) -> None:
        self.pieces.append(text)
        self.ends.append(self.num_chars + len(text))

    def slice(self, start: int, end: int) -> str:
        """text[start:end], joining only the pieces that overlap it."""
        if start >= end:
            return ""
        first = bisect.bisect_right(self.ends, start)
        last = bisect.bisect_left(self.ends, end)
        offset = self.ends[first - 1] if first else 0
        return "".join(self.pieces[first:last + 1])[start - offset:end - offset]

    def truncate(self, end: int) -> None:
        """Drop the text from character ``end`` on (a stop string's cut)."""
        while self.ends and self.ends[-1] > end:
            piece_start = self.ends[-2] if len(self.ends) > 1 else 0
            if piece_start >= end:
                self.pieces.pop()
                self.ends.pop()
            else:
                self.pieces[-1] = self.pieces[-1][:end - piece_start]
                self.ends[-1] = end


class RequestText:
    """One request, as the front end sees it: apply the engine's deltas, make outputs."""

    def __init__(self, request: EngineRequest, tokenizer: Any, token_texts: TokenTexts) -> None:
        params = request.params
        self.request_id = request.request_id
        self.prompt = request.prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params
        self.kind = params.output_kind
        self.token_texts = token_texts
        self.stops = StopChecker(params.stop, params.include_stop_str_in_output)
        self.seqs = [SeqText(i, IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, params.skip_special_tokens,
            params.spaces_between_special_tokens)
            if params.detokenize and tokenizer is not None else None,
            params.logprobs is not None) for i in range(params.n)]
        self.finished = False
        self.metrics = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._prompt_logprobs_sent = False
        self._changed: dict[int, SeqText] = {}     # since the last output

    # -- input -------------------------------------------------------------------------------
    def apply(self, out: EngineCoreOutput) -> list[int]:
        """Take one engine report; returns the indices of sequences a stop string just
        finished while the engine still runs them (the caller finishes them there)."""
        self.metrics, self.num_cached_tokens = out.metrics, out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = [None if raw is None else self.token_texts.entry(raw)
                                    for raw in out.prompt_logprobs]
        to_stop = []
        for delta in out.seqs:
            seq = self.seqs[delta.index]
            if seq.finish_reason is not None:
                continue                    # stopped here earlier: later tokens are dropped
            self._changed[seq.index] = seq
            if self._apply_tokens(seq, delta) and delta.finish_reason is None:
                to_stop.append(seq.index)
        self.finished = all(seq.finish_reason is not None for seq in self.seqs)
        return to_stop

    def _apply_tokens(self, seq: SeqText, delta: SeqDelta) -> bool:
        """Append a delta's tokens one by one; True when a stop string ended the sequence
        (its token ids and text then end at the token and character where it matched)."""
        ids, raw_logprobs = delta.new_token_ids, delta.new_logprobs
        last = len(ids) - 1
        for k, token in enumerate(ids):
            seq.token_ids.append(token)
            if raw_logprobs is not None and seq.logprobs is not None:
                seq.cumulative_logprob += raw_logprobs[k][1]
                seq.logprobs.append(self.token_texts.entry(raw_logprobs[k]))
            text = seq.detok.decode_next(token) if seq.detok is not None else ""
            if not text:
                continue
            seq.append(text)
            if k == last and delta.finish_reason == "stop":
                break           # EOS or a stop token: the engine's check comes first
            if self.stops.stop and len(seq.token_ids) > self.params.min_tokens \
                    and self.stops.may_complete(text):
                start = max(0, seq.num_chars - len(text) - self.stops.max_len + 1)
                match = self.stops.find(seq.slice(start, seq.num_chars), len(text))
                if match is not None:
                    seq.truncate(start + match[1])
                    seq.finish_reason, seq.stop_reason = "stop", match[0]
                    return True
        if delta.finish_reason is not None:
            tail = seq.detok.flush() if seq.detok is not None else ""
            if tail:
                seq.append(tail)
            seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        return False

    def fail(self) -> None:
        """End every unfinished sequence with finish_reason "error" (this request's own text
        processing raised: it alone ends; the caller aborts it in the engine)."""
        for seq in self.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
                self._changed[seq.index] = seq
        self.finished = True

    # -- output ------------------------------------------------------------------------------
    def make_output(self) -> RequestOutput | None:
        """The RequestOutput owed since the last one (None: nothing to send now)."""
        if self.kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if not self._changed and not (self.prompt_logprobs is not None
                                      and not self._prompt_logprobs_sent):
            return None
        delta = self.kind == RequestOutputKind.DELTA
        seqs = list(self._changed.values()) if delta else self.seqs
        self._changed = {}
        completions = [self._completion(seq, delta) for seq in seqs]
        prompt_logprobs = self.prompt_logprobs
        if delta and self._prompt_logprobs_sent:
            prompt_logprobs = None
        self._prompt_logprobs_sent = prompt_logprobs is not None or self._prompt_logprobs_sent
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, outputs=completions,
            finished=self.finished, num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics, prompt_logprobs=prompt_logprobs)

    def _completion(self, seq: SeqText, delta: bool) -> CompletionOutput:
        end = seq.num_chars
        if seq.finish_reason is None:      # withhold what may be the start of a stop string
            end = max(seq.sent_chars, end - self.stops.holdback)
        logprobs = seq.logprobs
        if delta:
            text = seq.slice(seq.sent_chars, end)
            token_ids = seq.token_ids[seq.sent_tokens:]
            if logprobs is not None:
                logprobs = logprobs[seq.sent_tokens:]
            seq.sent_chars, seq.sent_tokens = end, len(seq.token_ids)
        elif self.kind == RequestOutputKind.FINAL_ONLY:
            text, token_ids = seq.slice(0, end), seq.token_ids
        else:
            text, token_ids = seq.slice(0, end), list(seq.token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=seq.index, text=text, token_ids=token_ids,
            cumulative_logprob=seq.cumulative_logprob if logprobs is not None else None,
            logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)

"""The front end's output processing (vLLM's `OutputProcessor`): token deltas → RequestOutputs.

An engine core reports token ids and numeric logprobs (`EngineCoreOutput`); this builds the
text (incremental detokenization), the stop-string matches and the logprobs' token text, one
`RequestText` per request (jaxserve/engine/request_text.py), and says which sequences a stop
string ended so the front end can finish them in the core (their KV blocks are freed).

One class for both front ends: `LLMEngine` (LLM.generate, one thread) tracks its requests here
and calls `process_outputs` after each core step; `AsyncLLMEngine` keeps each request's text
with its stream and calls `apply` as the consumer reads, on the asyncio side, so the engine
thread never touches text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest
from jaxserve.engine.request_text import RequestText, TokenTexts
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ProcessedOutputs:
    """What one step's core outputs gave: RequestOutputs (by each request's output_kind),
    the (request id, sequence index) pairs a stop string finished that the core still runs,
    and the requests whose own text processing failed (the caller aborts them in the core)."""
    request_outputs: list[RequestOutput] = field(default_factory=list)
    sequences_to_finish: list[tuple[str, int]] = field(default_factory=list)
    requests_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Detokenization, stop strings and logprob text for one tokenizer's requests."""

    def __init__(self, tokenizer: Any) -> None:
        """tokenizer: None under skip_tokenizer_init (outputs carry token ids, no text)."""
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)      # shared by every request
        self.requests: dict[str, RequestText] = {}    # the tracked ones (`add_request`)

    def new_request_text(self, request: EngineRequest) -> RequestText:
        """A request's text state, not tracked here (the caller keeps it: a server stream)."""
        return RequestText(request, self.tokenizer, self.token_texts)

    def add_request(self, request: EngineRequest) -> None:
        """Track a request; its outputs come from `process_outputs`."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = self.new_request_text(request)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    @staticmethod
    def apply(text: RequestText, core_outputs: list[EngineCoreOutput]
              ) -> tuple[RequestOutput | None, list[int]]:
        """Feed one request's core outputs to its text state: the RequestOutput owed now
        (None: nothing to send yet) and the indices of sequences a stop string just ended
        while the core still runs them. Raises what the request's text processing raised."""
        to_stop: list[int] = []
        for core_output in core_outputs:
            if not text.finished:
                to_stop += text.apply(core_output)
        return text.make_output(), to_stop

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """One core step's outputs for the tracked requests. A request whose text processing
        raises ends alone, with finish_reason "error"."""
        processed = ProcessedOutputs()
        for core_output in core_outputs:
            text = self.requests.get(core_output.request_id)
            if text is None:
                continue                # finished here already (a stop string)
            try:
                output, to_stop = self.apply(text, [core_output])
            except Exception as exc:   # this request's text failed: it alone ends
                logger.error("request %s failed in output processing: %r",
                             text.request_id, exc, exc_info=exc)
                text.fail()
                processed.requests_to_abort.append(text.request_id)
                output, to_stop = text.make_output(), []
            processed.sequences_to_finish += [(text.request_id, i) for i in to_stop]
            if text.finished:
                del self.requests[text.request_id]
            if output is not None:
                processed.request_outputs.append(output)
        return processed

"""The front end for callers on one thread (LLM.generate, the terminal chat, tests).

It wraps an engine core (`LLMEngine`, `DataParallelEngine`) the way AsyncLLMEngine does
for the server: validate at the edge (`InputProcessor`), hand the core an `EngineRequest`,
and turn the core's token deltas into RequestOutputs (`RequestText`), finishing in the
core every sequence a stop string ended.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from jaxserve.engine.engine_io import EngineCoreOutput, EngineRequest, InputProcessor
from jaxserve.engine.request_text import RequestText, TokenTexts
from jaxserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class Frontend:
    def __init__(self, core: Any, tokenizer: Any, max_model_len: int, max_logprobs: int,
                 vocab_size: int | None = None) -> None:
        """tokenizer: None under skip_tokenizer_init (token-id prompts, outputs without
        text); vocab_size: the model's, which bounds prompt ids then."""
        self.core = core
        self.tokenizer = tokenizer
        self.inputs = InputProcessor(tokenizer, max_model_len, max_logprobs, vocab_size)
        self.token_texts = TokenTexts(tokenizer)
        self.requests: dict[str, RequestText] = {}

    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    sampling_params: Any = None, **kwargs: Any) -> None:
        """Validate and queue a request; ValueError (changing nothing) if it can never run."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.inputs.process(request_id, prompt, sampling_params, **kwargs)
        self.core.add_core_request(request)
        self.track(request)

    def track(self, request: EngineRequest) -> None:
        self.requests[request.request_id] = RequestText(request, self.tokenizer,
                                                        self.token_texts)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        self.core.abort_request(request_ids)

    def step(self) -> list[RequestOutput]:
        """One core step; the RequestOutputs it gives (by each request's output_kind)."""
        outputs, to_stop = self.process(self.core.step_core())
        if to_stop:
            self.core.finish_sequences(to_stop)
        return outputs

    def process(self, core_outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """RequestOutputs of a step's core outputs, and the (request id, sequence index)
        pairs a stop string finished that the core still runs."""
        outputs, to_stop = [], []
        for core_output in core_outputs:
            request = self.requests.get(core_output.request_id)
            if request is None:
                continue                # finished here already (a stop string)
            try:
                to_stop += [(request.request_id, i) for i in request.apply(core_output)]
            except Exception as exc:   # this request's text failed: it alone ends
                logger.error("request %s failed in output processing: %r",
                             request.request_id, exc, exc_info=exc)
                request.fail()
                self.core.abort_request(request.request_id)
            output = request.make_output()
            if request.finished:
                del self.requests[request.request_id]
            if output is not None:
                outputs.append(output)
        return outputs, to_stop

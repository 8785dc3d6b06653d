"""Spec → xgrammar grammar: checked against size/depth limits, parsed (errors are the
caller's ValueError), compiled against the tokenizer on a thread pool, cached per (kind, spec).

Parsing (``xgr.Grammar.from_*``) is tokenizer-independent but not always cheap (a JSON
schema's cost grows about cubically with depth; limits.py bounds it). The server parses
off its event loop and the engine thread, in `parse_grammar_cached` on a worker thread,
before it submits the request: an invalid spec is a 400 then, and the engine finds the
parsed grammar in the cache. `grammar_for` parses synchronously only on a cache miss
(offline `LLM` calls, where the caller's thread is the engine's). Computing token masks
for every grammar state against the vocabulary runs on the pool; a sequence whose grammar
is still compiling is not scheduled (jaxserve/engine/scheduler.py), and one that takes
longer than ``COMPILE_TIMEOUT_S`` ends its request with "error".
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from jaxserve.structured_outputs.limits import check_spec_limits
from jaxserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 512                    # compiled grammars kept (LRU)
_PARSED_CACHE_SIZE = 128             # parsed grammars kept (LRU), shared by every engine
# A grammar still compiling after this fails its request. The margin is for a 2-core box running
# many compiles at once; the spec's depth/size limits keep real compiles far shorter.
COMPILE_TIMEOUT_S = 120.0
_XGR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")   # "[22:14:11] /project/cpp/x.cc:94: "


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured outputs (and tool_choice 'required' or a named function) "
                         "need xgrammar: pip install 'jaxserve[structured]'") from None
    return xgrammar


def parse_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar `Grammar` of a spec; ValueError naming the problem if it is invalid."""
    xgr = import_xgrammar()

    kind = params.kind
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError("the JSON schema must be a JSON object")
            return xgr.Grammar.from_json_schema(json.dumps(schema),
                                                any_whitespace=not params.disable_any_whitespace)
        if kind == "json_object":
            # Any JSON object (OpenAI's json_object mode), whitespace as for schemas.
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=not params.disable_any_whitespace,
                strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from None
    except RuntimeError as exc:
        message = _XGR_LOCATION.sub("", str(exc).strip())
        raise ValueError(f"invalid structured outputs {kind}: {message}") from None


_parsed: OrderedDict[tuple, Any] = OrderedDict()
_parsed_lock = threading.Lock()


def parse_grammar_cached(params: StructuredOutputsParams) -> Any:
    """`parse_grammar` after the size/depth limits, remembered per spec (thread-safe).
    ValueError for a spec over the limits or invalid. Call it off hot threads."""
    check_spec_limits(params)
    key = params.key()
    with _parsed_lock:
        grammar = _parsed.get(key)
        if grammar is not None:
            _parsed.move_to_end(key)
            return grammar
    grammar = parse_grammar(params)
    with _parsed_lock:
        _parsed[key] = grammar
        while len(_parsed) > _PARSED_CACHE_SIZE:
            _parsed.popitem(last=False)
    return grammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarService:
    """Compiles grammars for one tokenizer and vocabulary (the model's logits size)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2) -> None:
        xgr = import_xgrammar()

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_workers)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="jaxserve-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()

    def grammar_for(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar; ValueError now if the spec is invalid."""
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(key)
                return future
        grammar = parse_grammar_cached(params)   # ValueError: the request fails now
        future = self._pool.submit(self._compiler.compile_grammar, grammar)
        with self._lock:
            self._cache[key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

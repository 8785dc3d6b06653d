"""Incremental detokenization and stop strings, for streaming text as tokens arrive.

One request's loop (what the engine does after each step)::

    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
    stops = StopChecker(params.stop, params.include_stop_str_in_output)
    ...
    delta = detokenizer.step(new_token_ids)
    match = stops.check(detokenizer.output_text, len(delta))
    if match:
        stop_str, text = match          # text: the output truncated at (or after) stop_str
        finished = True
    else:
        text = detokenizer.output_text
    stream_this = stops.stream(text, finished)   # never shows part of a stop string early

Detokenization follows vLLM's prefix/read-offset algorithm: each step decodes a
short window of tokens twice -- up to the last emitted token, and through the
new one -- and emits the difference. Decoding with a little context keeps the
leading space of a word that sentencepiece-style decoders strip at the start of
a string, and text ending in U+FFFD (an incomplete UTF-8 sequence of byte
tokens) is held back until the next token completes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

# how many prompt tokens of context the first decode window gets
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class TokenTable:
    """One tokenizer's id -> token string and tokens -> text, without transformers' per-call
    overhead (its convert_ids_to_tokens rebuilds the special-token set on every call, which
    was most of the engine's host time per step). Shared by every request: `for_tokenizer`."""

    _cache: "weakref.WeakKeyDictionary[Any, TokenTable]" = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = len(tokenizer)
        self.special_ids = frozenset(tokenizer.all_special_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:       # a fast tokenizer (all that transformers 5 loads)
            self._id_to_token: Callable[[int], str | None] = backend.id_to_token
            decoder = backend.decoder
            self.tokens_to_text: Callable[[list[str]], str] = (
                decoder.decode if decoder is not None else " ".join)
        else:
            self._id_to_token = tokenizer.convert_ids_to_tokens
            self.tokens_to_text = tokenizer.convert_tokens_to_string

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> TokenTable:
        try:
            table = cls._cache.get(tokenizer)
        except TypeError:             # not weak-referenceable: no sharing
            return cls(tokenizer)
        if table is None or table.vocab_size != len(tokenizer):   # tokens were added
            table = cls._cache[tokenizer] = cls(tokenizer)
        return table

    def tokens(self, token_ids: Sequence[int], skip_special_tokens: bool) -> list[str]:
        """Token strings of in-range ids (out-of-range ids are dropped, never a crash)."""
        skip = self.special_ids if skip_special_tokens else ()
        return [self._id_to_token(t) or "" for t in token_ids
                if 0 <= t < self.vocab_size and t not in skip]


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for one sequence.

    skip_special_tokens: drop special tokens (eos, <|im_end|> ...) from the text.
    spaces_between_special_tokens: accepted for vLLM compatibility; fast tokenizers
    (the only kind transformers 5 loads) never insert such spaces, as in vLLM.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self._table = TokenTable.for_tokenizer(tokenizer)
        # a few prompt tokens (plus two spare, in case some are special and skipped)
        context = list(prompt_token_ids)[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):]
        self.tokens: list[str] = self._to_tokens(context)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        return self._table.tokens(token_ids, self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they finalize (possibly "", never a broken char)."""
        deltas = []
        for token_id in new_token_ids:
            self.token_ids.append(int(token_id))
            self.tokens.extend(self._to_tokens([int(token_id)]))
            deltas.append(self._finalize())
        delta = "".join(deltas)
        self.output_text += delta
        return delta

    def _finalize(self) -> str:
        decode = self._table.tokens_to_text
        prefix_text = decode(self.tokens[self.prefix_offset:self.read_offset])
        new_text = decode(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # nothing new, or an unfinished UTF-8 sequence: wait for the next token
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text):]


def find_stop_string(output_text: str, new_char_count: int, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> tuple[str, str] | None:
    """The earliest stop string that the last `new_char_count` characters complete.

    Only the tail that can hold a new match is searched: a match must end inside the
    new text, so it starts at most ``len(stop_str) - 1`` characters before it.
    Returns (stop string, output text truncated before it -- or after it when
    include_stop_str_in_output), or None. Ties at one position go to the longest string.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        if not stop_str:
            continue
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop_str) > len(best[1])):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    end = index + len(stop_str) if include_stop_str_in_output else index
    return stop_str, output_text[:end]


class StopChecker:
    """Stop strings of one request, and how much of the text may be streamed so far.

    While unfinished, the last ``len(longest stop) - 1`` characters are withheld (when
    the stop string is excluded from the output), so a client never sees the start of
    a stop string that the next token completes -- vLLM's behaviour.
    """

    def __init__(self, stop: Sequence[str] | str | None = None,
                 include_stop_str_in_output: bool = False):
        if isinstance(stop, str):
            stop = [stop]
        self.stop = [s for s in (stop or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.holdback = (max((len(s) for s in self.stop), default=1) - 1
                         if self.stop and not include_stop_str_in_output else 0)
        self.streamed_chars = 0

    def check(self, output_text: str, new_char_count: int) -> tuple[str, str] | None:
        """(stop string, truncated text) if the newest text completes a stop string."""
        return find_stop_string(output_text, new_char_count, self.stop,
                                self.include_stop_str_in_output)

    def stream(self, output_text: str, finished: bool) -> str:
        """The next piece of `output_text` to send: all of it once finished, else all but the
        withheld tail. Pass the truncated text when a stop string matched."""
        end = len(output_text) if finished else max(len(output_text) - self.holdback, 0)
        if end <= self.streamed_chars:
            return ""
        piece = output_text[self.streamed_chars:end]
        self.streamed_chars = end
        return piece

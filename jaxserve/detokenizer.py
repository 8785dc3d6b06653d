"""Incremental detokenization and stop strings, for streaming text as tokens arrive.

These run on the front end's side of the engine (jaxserve/engine/request_text.py), never
on the engine thread. One sequence's loop::

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

Fast tokenizers (every one transformers 5 loads: byte-level BPE, sentencepiece-style
Metaspace/ByteFallback, WordPiece...) use `tokenizers.decoders.DecodeStream`, the Rust
incremental decoder vLLM v1 uses: it holds back an unfinished UTF-8 character by itself
and, primed with a few prompt tokens, keeps the leading space of the first word that
sentencepiece-style decoders strip at the start of a string.

Anything else with a ``decode`` (slow tokenizers, the tests' byte tokenizer) takes vLLM's
prefix/read-offset algorithm: each step decodes a short window of ids twice -- up to the
last emitted token, and through the new one -- and emits the difference; text ending in
U+FFFD (an incomplete UTF-8 sequence) waits for the next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# how many prompt tokens of context the first decode window gets
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"
_INVALID_PREFIX = "Invalid prefix encountered"   # DecodeStream's error for a broken prefix


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for one sequence.

    skip_special_tokens: drop special tokens (eos, <|im_end|> ...) from the text.
    spaces_between_special_tokens: accepted for vLLM compatibility; fast tokenizers never
    insert such spaces, as in vLLM. Out-of-vocabulary ids add no text (never a crash).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 *, use_decode_stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self._texts: list[str] = []     # output_text in pieces: appending is O(1) per step
        self._vocab_size = len(tokenizer)
        self._pending: list[int] = []   # ids fed since the last text (an unfinished char)
        # a few prompt tokens (plus two spare, in case some are special and skipped)
        context = [int(t) for t in prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
                                                      + 2):] if 0 <= t < self._vocab_size]
        backend = getattr(tokenizer, "backend_tokenizer", None) if use_decode_stream else None
        self._backend = backend
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=self._clean_context(prompt_token_ids),
                                        skip_special_tokens=skip_special_tokens)
            return
        self._window = context          # ids the next decode window starts from
        self._read_offset = len(context)

    def _clean_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest prompt suffix (4 to 24 tokens) that decodes to whole characters:
        DecodeStream would emit a broken character of its context with the first token."""
        ids = [int(t) for t in prompt_token_ids[-24:]]
        if any(not 0 <= t < self._vocab_size for t in ids):
            return []
        for length in range(min(4, len(ids)), len(ids) + 1):
            suffix = ids[len(ids) - length:]
            if _REPLACEMENT_CHAR not in self.tokenizer.decode(
                    suffix, skip_special_tokens=self.skip_special_tokens):
                return suffix
        return []

    @property
    def output_text(self) -> str:
        """All text so far (the deltas joined)."""
        if len(self._texts) > 1:
            self._texts[:] = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def step_token(self, token_id: int) -> str:
        """`step` for one token: the decode step's case."""
        self.token_ids.append(token_id)
        delta = self.decode_next(token_id)
        if delta:
            self._texts.append(delta)
        return delta

    def decode_next(self, token_id: int) -> str:
        """The text one more token finalizes, without keeping token ids or text here (for a
        caller that keeps them itself: jaxserve/engine/request_text.py)."""
        if not 0 <= token_id < self._vocab_size:
            return ""
        text = (self._stream_step(token_id) if self._backend is not None
                else self._window_step(token_id))
        if text:
            self._pending.clear()
        else:
            self._pending.append(token_id)
        return text

    def flush(self) -> str:
        """At the end of the sequence: the text of tokens still held back as an unfinished
        character, decoded as a whole decode would show them (U+FFFD for the broken bytes)."""
        if not self._pending:
            return ""
        text = self.tokenizer.decode(self._pending, skip_special_tokens=self.skip_special_tokens)
        self._pending.clear()
        return text

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they finalize (possibly "", never a broken char)."""
        return "".join([self.step_token(int(t)) for t in new_token_ids])

    def _stream_step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception as exc:    # the Rust side raises a bare Exception
            if _INVALID_PREFIX not in str(exc):
                raise
        # Invalid UTF-8 that a later token decodes differently breaks DecodeStream's prefix
        # invariant; start a fresh stream at this token, as vLLM does.
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return self._stream.step(self._backend, token_id) or ""

    def _window_step(self, token_id: int) -> str:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        self._window.append(token_id)
        prefix_text = decode(self._window[:self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._window, skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""       # nothing new, or an unfinished UTF-8 sequence: wait for more
        # the emitted tokens become the next window's context
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        return new_text[len(prefix_text):]


def find_stop_string(output_text: str, new_char_count: int, stop: Sequence[str],
                     include_stop_str_in_output: bool = False) -> tuple[str, str] | None:
    """The earliest stop string that the last `new_char_count` characters complete.

    Returns (stop string, output text truncated before it -- or after it when
    include_stop_str_in_output), or None. Ties at one position go to the longest string.
    """
    found = _earliest_stop(output_text, new_char_count, stop)
    if found is None:
        return None
    index, stop_str = found
    end = index + len(stop_str) if include_stop_str_in_output else index
    return stop_str, output_text[:end]


def _earliest_stop(text: str, new_char_count: int, stop: Sequence[str]
                   ) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string ending in the last `new_char_count`
    characters of `text`. A match ending there starts at most ``len(stop_str) - 1``
    characters before the new text, so only that tail is searched (`str.find`, no regex)."""
    if new_char_count <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        if not stop_str:
            continue
        start = max(0, len(text) - new_char_count - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index == -1:
            continue
        if best is None or index < best[0] or (index == best[0] and len(stop_str) > len(best[1])):
            best = (index, stop_str)
    return best


class StopChecker:
    """Stop strings of one request, and how much of the text may be streamed so far.

    While unfinished, the last ``len(longest stop) - 1`` characters are withheld (when
    the stop string is excluded from the output), so a client never sees the start of
    a stop string that the next token completes -- vLLM's behaviour. Nothing is compiled:
    a check is one `str.find` per stop string over the tail that could hold a new match.
    """

    def __init__(self, stop: Sequence[str] | str | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        # longest first: at one position the longest string wins (find_stop_string's rule)
        self.stop = sorted(dict.fromkeys(s for s in (stop or ()) if s), key=len, reverse=True)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.holdback = (self.max_len - 1
                         if self.stop and not include_stop_str_in_output else 0)
        self.streamed_chars = 0
        # A match that ends in new text has its last character there.
        self._last_chars = frozenset(s[-1] for s in self.stop)

    def may_complete(self, new_text: str) -> bool:
        """False when ``new_text`` (the newest delta) cannot complete any stop string."""
        return not self._last_chars.isdisjoint(new_text)

    def find(self, text: str, new_char_count: int) -> tuple[str, int] | None:
        """(stop string, where `text` is cut) if its last ``new_char_count`` characters
        complete a stop string; `text` needs only its last ``max_len - 1 + new_char_count``
        characters."""
        found = _earliest_stop(text, new_char_count, self.stop)
        if found is None:
            return None
        index, stop_str = found
        return stop_str, index + len(stop_str) if self.include_stop_str_in_output else index

    def check(self, output_text: str, new_char_count: int) -> tuple[str, str] | None:
        """(stop string, truncated text) if the newest text completes a stop string."""
        found = self.find(output_text, new_char_count)
        return None if found is None else (found[0], output_text[:found[1]])

    def stream(self, output_text: str, finished: bool) -> str:
        """The next piece of `output_text` to send: all of it once finished, else all but the
        withheld tail. Pass the truncated text when a stop string matched."""
        end = len(output_text) if finished else max(len(output_text) - self.holdback, 0)
        if end <= self.streamed_chars:
            return ""
        piece = output_text[self.streamed_chars:end]
        self.streamed_chars = end
        return piece

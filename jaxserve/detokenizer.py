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

Byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen) take a fast path: each
token is a fixed byte string, so a step is one table lookup and one call of an
incremental UTF-8 decoder, which holds back an unfinished character by itself. The
table is built once per tokenizer and checked against the tokenizer's own decoder;
if they ever disagree, the general path below is used.

The general path follows vLLM's prefix/read-offset algorithm: each step decodes a
short window of tokens twice -- up to the last emitted token, and through the
new one -- and emits the difference. Decoding with a little context keeps the
leading space of a word that sentencepiece-style decoders strip at the start of
a string, and text ending in U+FFFD (an incomplete UTF-8 sequence of byte
tokens) is held back until the next token completes it.
"""

from __future__ import annotations

import codecs
import random
import re
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

        self._decoder = backend.decoder if backend is not None else None
        self._byte_pieces: list[bytes] | None | bool = False     # False: not built yet
        self._piece_texts: list[str | None] | None = None

    @property
    def byte_pieces(self) -> list[bytes] | None:
        """id -> the bytes that token decodes to, for byte-level BPE decoders; else None."""
        if self._byte_pieces is False:
            self._byte_pieces = self._build_byte_pieces()
        return self._byte_pieces  # type: ignore[return-value]

    @property
    def piece_texts(self) -> list[str | None]:
        """id -> its byte piece as text when that piece is whole UTF-8 characters (most
        tokens), else None: a step after a complete character needs no incremental decoder."""
        if self._piece_texts is None:
            texts: list[str | None] = []
            for piece in self.byte_pieces or ():
                try:
                    texts.append(piece.decode("utf-8"))
                except UnicodeDecodeError:
                    texts.append(None)
            self._piece_texts = texts
        return self._piece_texts

    def _build_byte_pieces(self) -> list[bytes] | None:
        if self._decoder is None or type(self._decoder).__name__ != "ByteLevel":
            return None
        byte_of = _gpt2_byte_decoder()
        pieces = []
        for token_id in range(self.vocab_size):
            token = self._id_to_token(token_id) or ""
            pieces.append(b"".join(bytes((byte_of[c],)) if c in byte_of else c.encode()
                                   for c in token))
        # Trust it only where it reproduces the tokenizer's own decoder.
        rng = random.Random(0)
        for _ in range(64):
            ids = [rng.randrange(self.vocab_size) for _ in range(rng.randrange(1, 24))]
            tokens = [self._id_to_token(t) or "" for t in ids]
            if self.tokens_to_text(tokens) != b"".join(pieces[t] for t in ids).decode(
                    "utf-8", "replace"):
                return None
        return pieces

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
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 *, byte_fast_path: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self._texts: list[str] = []     # output_text in pieces: appending is O(1) per step
        self._table = TokenTable.for_tokenizer(tokenizer)
        self._pieces = self._table.byte_pieces if byte_fast_path else None
        if self._pieces is not None:        # the byte-level fast path (module docstring)
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._piece_texts = self._table.piece_texts
            self._utf8_holds_bytes = False  # the decoder holds part of a character
            self._skip = self._table.special_ids if skip_special_tokens else frozenset()
            return
        # a few prompt tokens (plus two spare, in case some are special and skipped)
        context = list(prompt_token_ids)[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):]
        self.tokens: list[str] = self._to_tokens(context)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)

    @property
    def output_text(self) -> str:
        """All text so far (the deltas joined)."""
        if len(self._texts) > 1:
            self._texts[:] = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def step_token(self, token_id: int) -> str:
        """`step` for one token: the engine's per-sequence, per-step call."""
        pieces = self._pieces
        if pieces is None:
            return self.step((token_id,))
        self.token_ids.append(token_id)
        if not 0 <= token_id < len(pieces) or token_id in self._skip:
            return ""
        delta = None if self._utf8_holds_bytes else self._piece_texts[token_id]
        if delta is None:      # part of a character, or completing one: the decoder's job
            delta = self._utf8.decode(pieces[token_id])
            self._utf8_holds_bytes = bool(self._utf8.getstate()[0])
        if delta:
            self._texts.append(delta)
        return delta

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        return self._table.tokens(token_ids, self.skip_special_tokens)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they finalize (possibly "", never a broken char)."""
        if self._pieces is not None:
            if len(new_token_ids) == 1:         # the decode step's case
                return self.step_token(new_token_ids[0])
            pieces, skip, vocab = self._pieces, self._skip, len(self._pieces)
            data = b"".join(pieces[t] for t in new_token_ids if 0 <= t < vocab and t not in skip)
            self.token_ids.extend(new_token_ids)
            delta = self._utf8.decode(data)
            self._utf8_holds_bytes = bool(self._utf8.getstate()[0])
            if delta:
                self._texts.append(delta)
            return delta
        deltas = []
        for token_id in new_token_ids:
            self.token_ids.append(int(token_id))
            self.tokens.extend(self._to_tokens([int(token_id)]))
            deltas.append(self._finalize())
        delta = "".join(deltas)
        if delta:
            self._texts.append(delta)
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


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character map, inverted (what ByteLevel decoders undo)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


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
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.holdback = (self.max_len - 1
                         if self.stop and not include_stop_str_in_output else 0)
        self.streamed_chars = 0
        # One C-level scan for all stop strings; longest first, so that at the earliest
        # position the longest string wins (find_stop_string's rule).
        self._pattern = re.compile("|".join(
            re.escape(s) for s in sorted(set(self.stop), key=len, reverse=True))) \
            if self.stop else None
        # A match that ends in new text has its last character there: one C-level scan of the
        # new text for those characters rules out most steps (`may_complete`).
        self._last_chars = re.compile("[" + "".join(sorted({re.escape(s[-1]) for s in self.stop}))
                                      + "]") if self.stop else None

    def may_complete(self, new_text: str) -> bool:
        """False when ``new_text`` (the newest delta) cannot complete any stop string."""
        return self._last_chars is not None and self._last_chars.search(new_text) is not None

    def check(self, output_text: str, new_char_count: int) -> tuple[str, str] | None:
        """(stop string, truncated text) if the newest text completes a stop string."""
        if new_char_count <= 0 or self._pattern is None:
            return None
        start = max(0, len(output_text) - new_char_count - self.max_len + 1)
        old_end = len(output_text) - new_char_count     # a match must end past this
        match = self._pattern.search(output_text, start)
        while match is not None and match.end() <= old_end:
            match = self._pattern.search(output_text, match.start() + 1)
        if match is None:
            return None
        end = match.end() if self.include_stop_str_in_output else match.start()
        return match.group(), output_text[:end]

    def stream(self, output_text: str, finished: bool) -> str:
        """The next piece of `output_text` to send: all of it once finished, else all but the
        withheld tail. Pass the truncated text when a stop string matched."""
        end = len(output_text) if finished else max(len(output_text) - self.holdback, 0)
        if end <= self.streamed_chars:
            return ""
        piece = output_text[self.streamed_chars:end]
        self.streamed_chars = end
        return piece

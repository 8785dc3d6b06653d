"""Per-request sampling parameters, with vLLM's field names, defaults and validation.

Every check runs in ``__post_init__`` and raises ``ValueError`` naming the bad
value and the allowed range, in vLLM's words. Limits that depend on the
engine (``max_logprobs``, the vocabulary) are checked by ``verify``.

Unset versus default: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``repetition_penalty`` accept ``None``, meaning "not set by the user". They
are resolved to vLLM's defaults (1.0, 1.0, 0, 0.0, 1.0) at construction, and
``update_from_generation_config`` later replaces only the unset ones with the
model's generation_config.json values, as vLLM does. The names the user did
set are kept in ``user_set``. ``dataclasses.replace`` passes every value again
and so marks all five as set; use ``clone()`` to copy.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from jaxserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5     # temperature below this is greedy
_MIN_TEMP = 1e-2         # vLLM raises smaller positive temperatures to this
MAX_LOGIT_BIAS_ENTRIES = 300
# Request-size limits (ours; vLLM has none): generous for any real use, small enough that one
# request's stop strings cannot cost the server noticeable memory or matching time.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 4096
# Integers that reach int32 host/device arrays (top_k, logprobs, token counts) must fit one.
INT32_MAX = 2**31 - 1
# Seeds: vLLM takes any int64; we also take the uint64 range (seeds are folded to 32 bits).
SEED_RANGE = (-(2**63), 2**64 - 1)
# Floats that reach float32 device arrays must be finite there too.
FLOAT32_MAX = 3.4028234663852886e38
# Fields whose model default may come from generation_config.json, and vLLM's defaults.
GENERATION_CONFIG_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
}


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's): everything so far, only what is
    new since the last one, or one output when the request finishes (LLM.generate's)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completions of one request (vLLM semantics)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None    # None: unset → 1.0 (or generation config)
    temperature: float | None = None           # None: unset → 1.0 (or generation config)
    top_p: float | None = None                 # None: unset → 1.0 (or generation config)
    top_k: int | None = None                   # None: unset → 0; 0 or -1 disable (-1 → 0)
    min_p: float | None = None                 # None: unset → 0.0 (or generation config)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16                # None: up to max_model_len (engine resolves)
    min_tokens: int = 0
    logprobs: int | None = None                # top-N logprobs per output token
    prompt_logprobs: int | None = None         # top-N logprobs per prompt token
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None   # constrained decoding
    guided_decoding: StructuredOutputsParams | None = field(default=None, repr=False)  # old name
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    user_set: frozenset[str] = field(default=frozenset(), init=False, repr=False,
                                     compare=False)

    def __post_init__(self) -> None:
        self.user_set = frozenset(
            name for name in GENERATION_CONFIG_DEFAULTS if getattr(self, name) is not None)
        for name, default in GENERATION_CONFIG_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, "
                             f"got {_short(self.stop)}.")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, "
                             f"got {_short(self.stop_token_ids)}.")
        else:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.guided_decoding is not None:      # vLLM's older name for the same thing
            if self.structured_outputs is not None:
                raise ValueError("set structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        self._normalize_and_verify()

    # -- validation ---------------------------------------------------------------------
    def _normalize_and_verify(self) -> None:
        """Check every field, then apply vLLM's normalizations (top_k -1 → 0, greedy).
        The checks run in field order, so a request with several bad fields is told of
        the first."""
        self._verify_n()
        self._verify_penalties()
        self._verify_temperature()
        self._verify_filters()
        self._verify_seed()
        self._verify_lengths()
        self._verify_logprobs()
        self._verify_stop()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change an argmax, so make them neutral (as vLLM).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify_n(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {_short(self.n)}.")
        if self.n > INT32_MAX:
            raise ValueError(f"n must be at most {INT32_MAX}, got {_short(self.n)}.")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must be None or equal to n={self.n} (best_of > n is "
                             f"not supported), got {_short(self.best_of)}.")

    def _verify_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_finite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {_short(value)}.")
        if not _is_finite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, "
                             f"got {_short(self.repetition_penalty)}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, "
                             f"got {_short(self.repetition_penalty)}.")

    def _verify_temperature(self) -> None:
        if not _is_finite(self.temperature):
            raise ValueError(f"temperature must be a finite number (float32), "
                             f"got {_short(self.temperature)}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, "
                             f"got {_short(self.temperature)}.")
        if 0.0 < self.temperature < _MIN_TEMP:
            logger.warning("temperature %s is less than %s, which may cause numerical errors "
                           "nan or inf in tensors. We have maxed it out to %s.",
                           self.temperature, _MIN_TEMP, _MIN_TEMP)
            self.temperature = _MIN_TEMP

    def _verify_filters(self) -> None:
        """top_p, top_k (-1 → 0: off) and min_p."""
        if not (_is_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {_short(self.top_p)}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__} "
                             f"{_short(self.top_k)}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, "
                             f"got {_short(self.top_k)}.")
        if self.top_k > INT32_MAX:
            raise ValueError(f"top_k must be at most the vocabulary size, "
                             f"got {_short(self.top_k)}.")
        if self.top_k == -1:
            self.top_k = 0
        if not (_is_finite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {_short(self.min_p)}.")

    def _verify_seed(self) -> None:
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
                raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] "
                                 f"(a 64-bit integer), got {_short(self.seed)}.")

    def _verify_lengths(self) -> None:
        """max_tokens and min_tokens."""
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            # max_tokens=0 is "prefill only", for prompt logprobs (vLLM's API serves echo with
            # max_tokens=0 by generating one token it drops; we skip generating it).
            if self.max_tokens > INT32_MAX:
                raise ValueError(f"max_tokens must be at most {INT32_MAX}, "
                                 f"got {_short(self.max_tokens)}.")
            if self.max_tokens < 1 and not (self.max_tokens == 0
                                            and self.prompt_logprobs is not None):
                raise ValueError(f"max_tokens must be at least 1, got {_short(self.max_tokens)} "
                                 "(0 only with prompt_logprobs).")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise ValueError(f"min_tokens must be greater than or equal to 0, "
                             f"got {_short(self.min_tokens)}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to "
                             f"max_tokens={self.max_tokens}, got {_short(self.min_tokens)}.")

    def _verify_logprobs(self) -> None:
        """logprobs and prompt_logprobs (their engine limit: `verify`)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value)
            if value < 0:
                raise ValueError(f"{name} must be non-negative, got {_short(value)}.")
            if value > INT32_MAX:
                raise ValueError(f"{name} must be at most max_logprobs, got {_short(value)}.")

    def _verify_stop(self) -> None:
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, "
                             f"got {_short(self.stop)}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may have at most {MAX_STOP_STRINGS} strings, "
                             f"got {len(self.stop)}.")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"each stop string may be at most {MAX_STOP_STRING_CHARS} "
                             f"characters, got one of {longest}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")

    def verify(self, max_logprobs: int, max_model_len: int,
               vocab_size: int | None = None) -> None:
        """Check the limits that depend on the engine; raises ValueError.

        ``vocab_size`` (optional) also checks logit_bias and stop_token_ids ids.
        """
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"Requested sample logprobs of {self.logprobs}, "
                             f"which is greater than max allowed: {max_logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            raise ValueError(f"Requested prompt logprobs of {self.prompt_logprobs}, "
                             f"which is greater than max allowed: {max_logprobs}")
        if self.min_tokens > max_model_len:
            raise ValueError(f"min_tokens must be at most max_model_len={max_model_len}, "
                             f"got {self.min_tokens}.")
        if vocab_size is not None:
            if self.top_k > vocab_size:
                raise ValueError(f"top_k cannot be greater than vocabulary size "
                                 f"({vocab_size}), got {self.top_k}.")
            for name, ids in (("logit_bias", list(self.logit_bias or ())),
                              ("stop_token_ids", self.stop_token_ids)):
                invalid = [t for t in ids if t < 0 or t >= vocab_size]
                if invalid:
                    raise ValueError(f"token_id(s) {_short(invalid)} in {name} contain "
                                     f"out-of-vocab token ids. Vocabulary size: {vocab_size}")

    # -- derived ------------------------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> "SamplingParams":
        """A deep copy (keeps which fields the user set)."""
        return copy.deepcopy(self)

    def update_from_generation_config(self, generation_config: dict[str, Any]) -> None:
        """Use the model's generation_config.json values for the fields the user did not set.

        Only temperature, top_p, top_k, min_p and repetition_penalty are read (vLLM's
        list, less max_new_tokens); other keys are ignored. Raises ValueError if a value
        from the config is out of range.
        """
        changed = False
        for name in GENERATION_CONFIG_DEFAULTS:
            value = generation_config.get(name)
            if value is not None and name not in self.user_set:
                setattr(self, name, value)
                changed = True
        if changed:
            self._normalize_and_verify()


def _normalize_logit_bias(logit_bias: dict[Any, Any]) -> dict[int, float]:
    """Integer keys (OpenAI sends strings), values clamped to [-100, 100] like vLLM."""
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got "
                         f"{type(logit_bias).__name__}.")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                         f"got {len(logit_bias)}.")
    out: dict[int, float] = {}
    for token, bias in logit_bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias contains key(s) that cannot be converted to "
                             f"integer token IDs: {_short(token)}") from None
        if isinstance(token, float) and token != token_id or isinstance(token, bool):
            raise ValueError(f"logit_bias keys must be integer token IDs, got {_short(token)}")
        if not _is_real(bias) or (isinstance(bias, float) and math.isnan(bias)):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], "
                             f"got {_short(bias)} for token {token_id}.")
        out[token_id] = float(min(100, max(-100, bias)))
    return out


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    """A real number that stays finite as a float32 (what the step's arrays hold)."""
    if not _is_real(value):
        return False
    try:
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    except OverflowError:          # an int too large for any float
        return False


def _short(value: Any, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters: an error message must not echo a huge input."""
    try:
        text = repr(value)
    except ValueError:             # an int beyond Python's digit limit for str()
        return f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} "
                         f"{_short(value)}.")

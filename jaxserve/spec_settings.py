"""vLLM's ``speculative_config`` dict, validated into one frozen settings object.

The dict is what users already pass to vLLM (``--speculative-config '{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'``); it
reaches us from the CLI as JSON, from YAML as a mapping and from ``LLM(speculative_config=)``
as a dict. Every key is checked here, once, so a typo is a clear ValueError at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "disable_by_batch_size"},
    "draft_model": {"method", "model", "num_speculative_tokens", "disable_by_batch_size"},
}
# No drafts above this many running sequences (vLLM's key name). Measured on the shared
# 2-core CPU box, SmolLM2-135M, k=4 (benchmarks/results/spec-cpu.json): one stream gains
# 2.5x on a copy task and loses nothing on chat; at 8 streams the step verifies 40 tokens
# (bucket 64, no longer bound by reading the weights), so chat's mostly rejected drafts
# cost 16% while a copy task still gains 1.3x. The cut sits between: 4.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpecDecodeSettings:
    method: str
    num_speculative_tokens: int          # k: drafts per row per step (the verify width is k+1)
    prompt_lookup_max: int = 4           # ngram: longest suffix n-gram matched
    prompt_lookup_min: int = 2           # ngram: shortest
    model: str | None = None             # draft_model: its path
    # No drafts while more sequences than this are running (or could be admitted).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE


def parse_speculative_config(value: dict[str, Any] | str | None) -> SpecDecodeSettings | None:
    """The validated settings, or None when speculation is off (None / empty)."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}: "
                             f"{exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {list(METHODS)}, "
                         f"got {method!r}")
    unknown = set(value) - _KEYS[method]
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {sorted(unknown)} for method "
                         f"{method!r}; allowed: {sorted(_KEYS[method])}")
    k = value.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an int in "
                         f"[1, 16], got {k!r}")
    disable = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if not isinstance(disable, int) or disable < 1:
        raise ValueError(f"speculative_config: disable_by_batch_size must be an int >= 1, "
                         f"got {disable!r}")
    if method == "ngram":
        lo = value.get("prompt_lookup_min", 2)
        hi = value.get("prompt_lookup_max", max(4, lo))
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max <= 64, got {lo!r} and {hi!r}")
        return SpecDecodeSettings("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                                  disable_by_batch_size=disable)
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config: method 'draft_model' needs 'model' (a path)")
    return SpecDecodeSettings("draft_model", k, model=model, disable_by_batch_size=disable)

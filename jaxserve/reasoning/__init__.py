"""Reasoning parsers (``--reasoning-parser``, vLLM's names): split a reasoning model's
output into its thinking and its answer. A front-end concern: the engine only learns
the end-of-thinking token id, after which a structured-output grammar applies."""

from __future__ import annotations

from typing import Any

from jaxserve.reasoning.think_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str, prompt_text: str = "") -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](prompt_text)


def reasoning_end_token_id(name: str, tokenizer: Any) -> int | None:
    """The end-of-thinking token's id, if the tokenizer has it as one token."""
    end = REASONING_PARSERS[name].end_token
    ids = tokenizer.encode(end, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser",
           "reasoning_end_token_id"]

"""What a request asks its output to match: vLLM's `StructuredOutputsParams`.

Exactly one constraint is set: ``json`` (a JSON schema, dict or string),
``regex``, ``choice`` (one of N strings), ``grammar`` (EBNF, xgrammar's
GBNF dialect) or ``json_object`` (any JSON object). Validation against the
tokenizer-independent grammar parser happens in `GrammarService.validate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM fields we recognise but do not implement: setting one is an error, never ignored.
_UNSUPPORTED = ("structural_tag", "whitespace_pattern", "disable_additional_properties")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False      # JSON: no whitespace between tokens
    disable_fallback: bool = False            # one backend (xgrammar): nothing to fall back to
    backend: str | None = None                # None, "auto" or "xgrammar"
    structural_tag: str | None = None         # recognised, not implemented
    whitespace_pattern: str | None = None     # recognised, not implemented
    disable_additional_properties: bool = False   # recognised, not implemented
    # Set by the server's reasoning parser, never by a client: the constraint starts after
    # this token (the end of the model's thinking). Not part of the grammar's cache key.
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        unsupported = [name for name in _UNSUPPORTED if getattr(self, name)]
        if unsupported:
            raise ValueError(f"structured outputs: {', '.join(unsupported)} is not supported "
                             "by jaxserve yet")
        if self.backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"structured outputs backend must be 'auto' or 'xgrammar', "
                             f"got {self.backend!r}")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("You must use exactly one kind of structured outputs constraint "
                             f"(one of {', '.join(CONSTRAINT_FIELDS)}); got "
                             f"{', '.join(given) or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured outputs choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured outputs {name} must be a string, got "
                                 f"{type(value).__name__}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured outputs json must be a JSON schema (dict or string), "
                             f"got {type(self.json).__name__}")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's ``structured_outputs`` object; unknown names are an error."""
        cls.check_names(fields)
        return cls(**fields)

    @classmethod
    def check_names(cls, fields: dict[str, Any]) -> None:
        """ValueError naming every field of ``fields`` a request may not set."""
        known = set(cls.__slots__) - {"reasoning_end_token_id"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical spec, whitespace flag): the grammar cache key."""
        kind = self.kind
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json,
                                                                           sort_keys=True)
        elif kind == "choice":
            spec = json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec, self.disable_any_whitespace

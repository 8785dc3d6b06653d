"""Size and depth limits of a structured-outputs spec, checked before anything parses it.

xgrammar's JSON-schema conversion grows about cubically with nesting depth (a 300-level
schema of 18 KB takes seconds), so a spec is bounded in size and, for JSON schemas, in
nesting depth. The check is linear in the spec's size and never recurses, so it is cheap
enough to run anywhere, the event loop included.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.structured_outputs_params import StructuredOutputsParams

MAX_SPEC_CHARS = 64 * 1024      # a schema, regex, grammar or the choices, serialized
MAX_SCHEMA_DEPTH = 64           # JSON nesting levels of a schema (an object property: 2)
MAX_CHOICES = 1024


def check_spec_limits(params: StructuredOutputsParams) -> None:
    """ValueError naming the limit when ``params``' spec is too large or too deep."""
    kind = params.kind
    if kind == "json_object":
        return
    if kind == "choice" and len(params.choice) > MAX_CHOICES:
        raise ValueError(f"structured outputs choice may have at most {MAX_CHOICES} options, "
                         f"got {len(params.choice)}")
    if kind == "json":          # depth first: serializing a deep dict would recurse
        schema: Any = params.json
        if isinstance(schema, str):
            if len(schema) > MAX_SPEC_CHARS:
                raise ValueError(f"structured outputs json is too large: {len(schema)} "
                                 f"characters (the limit is {MAX_SPEC_CHARS})")
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"invalid JSON schema: {exc}") from None
        depth = nesting_depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured outputs json schema is nested too deeply: {depth} "
                             f"levels (the limit is {MAX_SCHEMA_DEPTH})")
    spec = params.key()[1]
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"structured outputs {kind} is too large: {len(spec)} characters "
                         f"(the limit is {MAX_SPEC_CHARS})")


def nesting_depth(value: Any) -> int:
    """Levels of dicts and lists in a JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest

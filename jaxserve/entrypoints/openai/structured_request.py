"""A request's structured-output constraint, from whichever field it came in.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's
``structured_outputs`` object, or vLLM's legacy ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``: at most one of them, else a 400 (as vLLM).
Whether the spec itself is valid (schema, regex, grammar) is checked when the engine
admits the request (`GrammarService.grammar_for`), which is also a 400.
"""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.errors import APIError
from jaxserve.entrypoints.openai.protocol import SamplingFields
from jaxserve.structured_outputs_params import CONSTRAINT_FIELDS, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs_of(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None; APIError (400) for a bad or conflicting one."""
    sources: list[tuple[str, dict[str, Any]]] = []
    response_format = _response_format(request.response_format)
    if response_format is not None:
        sources.append(("response_format", response_format))
    options: dict[str, Any] = {}
    if request.structured_outputs is not None:
        fields = dict(request.structured_outputs)
        if any(fields.get(name) not in (None, False) for name in CONSTRAINT_FIELDS):
            sources.append(("structured_outputs", fields))
        else:
            # Options only (disable_any_whitespace, ...): they modify whichever field
            # carries the constraint, e.g. response_format.
            options = {k: v for k, v in fields.items() if v is not None}
    guided = {field: getattr(request, name) for name, field in _GUIDED.items()
              if getattr(request, name) is not None}
    if guided:
        sources.append(("guided_*", guided))
    if len(sources) > 1:
        raise APIError("You can only use one kind of structured outputs constraint but got "
                       f"{' and '.join(name for name, _ in sources)}",
                       param=sources[1][0])
    if request.guided_whitespace_pattern is not None:
        raise APIError("guided_whitespace_pattern is not supported by jaxserve yet",
                       param="guided_whitespace_pattern")
    if request.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise APIError(f"guided_decoding_backend must be 'auto' or 'xgrammar', got "
                       f"{request.guided_decoding_backend!r}", param="guided_decoding_backend")
    if not sources:
        if options:
            try:                          # a misspelt constraint is named as such
                StructuredOutputsParams.check_names(options)
            except ValueError as exc:
                raise APIError(str(exc), param="structured_outputs") from None
            raise APIError("structured_outputs sets options but no constraint (json, regex, "
                           "choice, grammar or json_object), nor does response_format",
                           param="structured_outputs")
        return None
    param, fields = sources[0]
    try:
        return StructuredOutputsParams.from_dict({**fields, **options})
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=param) from None


def _response_format(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """StructuredOutputsParams fields for OpenAI's response_format (None for text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object with a `schema`",
                           param="response_format.json_schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            # OpenAI allows a name-only json_schema: any JSON object then.
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON object",
                           param="response_format.json_schema.schema")
        return {"json": schema}
    if kind == "structural_tag":
        raise APIError("response_format type 'structural_tag' is not supported by jaxserve yet",
                       param="response_format.type")
    raise APIError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", param="response_format.type")

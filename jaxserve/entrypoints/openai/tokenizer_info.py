"""GET /tokenizer_info (vLLM's, behind --enable-tokenizer-info-endpoint): the tokenizer's
configuration, so a client (lm-eval's `tokenizer_backend=remote`) can tokenize like us.

The body is the tokenizer's init kwargs (special tokens as strings, file paths and values
JSON cannot hold dropped), its class name, and the chat template in use: the server's
--chat-template, else the tokenizer's own (vLLM sends only the former; a client rendering
chats needs the template either way).
"""

from __future__ import annotations

from typing import Any

_JSON_SCALARS = (str, int, float, bool, type(None))
_FILE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    config = {key: _jsonable(value) for key, value in
              dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _FILE_FIELDS}
    config = {key: value for key, value in config.items() if value is not _DROP}
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


_DROP = object()


def _jsonable(value: Any) -> Any:
    """Special tokens (AddedToken) as their text; containers element-wise; the rest dropped."""
    if hasattr(value, "content") and isinstance(value.content, str):
        return value.content
    if isinstance(value, dict):
        items = {str(k): _jsonable(v) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _DROP}
    if isinstance(value, (list, tuple)):
        return [v for v in map(_jsonable, value) if v is not _DROP]
    return value if isinstance(value, _JSON_SCALARS) else _DROP

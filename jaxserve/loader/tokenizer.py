"""Tokenizer loading and chat templates (the ids that end a sequence: engine/model_setup.eos_ids).

    tokenizer = load_tokenizer("/models/Qwen3-0.6B")          # or a .gguf, a repo id, a LoadedModel
    prompt_ids = apply_chat_template(tokenizer, [{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def load_tokenizer(source: Any, chat_template: str | None = None, hub: Any = None) -> Any:
    """A Hugging Face tokenizer from a model directory, .gguf file, Hub repo id or LoadedModel.

    chat_template: a Jinja template, or a path to a file holding one, that replaces the
    model's own (vLLM's ``--chat-template``). hub: a HubOptions (revision, cache, token)
    for a repo id; only the tokenizer's files are downloaded.
    """
    if hasattr(source, "tokenizer") and hasattr(source, "weights"):  # a LoadedModel
        tokenizer = source.tokenizer
    else:
        from jaxserve.loader.resolve import resolve_model

        resolved = resolve_model(source, hub, kind="tokenizer")
        if resolved.format == "gguf":
            from jaxserve.loader.gguf_loader import gguf_tokenizer

            tokenizer = gguf_tokenizer(resolved.path)
        elif resolved.format == "orbax":
            from jaxserve.loader.orbax_checkpoint import load_checkpoint_tokenizer

            tokenizer = load_checkpoint_tokenizer(resolved.path)
        else:
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(resolved.path,
                                                                   local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(template_or_path: str | os.PathLike) -> str:
    """A chat template given inline or as a path to a file holding one."""
    text = str(template_or_path)
    if "{" not in text and "\n" not in text and len(text) < 4096:  # not a Jinja template itself
        path = Path(os.path.expanduser(text))
        if not path.is_file():
            from jaxserve.chat_templates import bundled_names, bundled_template

            bundled = bundled_template(text)
            if bundled is not None:
                return bundled
            raise FileNotFoundError(f"chat template file {text!r} does not exist (and the value "
                                    "is not a Jinja template, nor a bundled template name: "
                                    f"{', '.join(bundled_names())})")
        return path.read_text()
    return text


def flatten_content(content: Any) -> str:
    """Message content as a plain string: a string, or a list of ``{"type": "text", "text": ...}``.

    Non-text parts (images, audio) are rejected: no supported model reads them.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text")
        if kind != "text":
            raise ValueError(f"message content part of type {kind!r} is not supported; "
                             "only 'text' parts are")
        texts.append(part.get("text", ""))
    return "\n".join(texts)


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                chat_template: str | None = None, add_generation_prompt: bool = True,
                **template_kwargs: Any) -> str:
    """The prompt text a chat template makes of `messages` (contents flattened to strings)."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template",
                                                                       None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; pass one with "
                         "--chat-template (a Jinja template or a path to one)")
    flat = [{**message, "content": flatten_content(message.get("content"))} for message in messages]
    return tokenizer.apply_chat_template(flat, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def apply_chat_template(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                        chat_template: str | None = None, add_generation_prompt: bool = True,
                        **template_kwargs: Any) -> list[int]:
    """Prompt token ids for a chat: the rendered template, tokenized without adding specials.

    Templates write their own BOS/special tokens, so (as vLLM does) none are added again.
    template_kwargs reach the template (e.g. ``enable_thinking=False`` for Qwen3).
    """
    if tokenizer is None:
        raise ValueError("a chat needs the tokenizer's chat template, and "
                         "`skip_tokenizer_init` is True: pass prompt_token_ids instead")
    text = render_chat(tokenizer, messages, chat_template, add_generation_prompt,
                       **template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode_releasing_gil(tokenizer: Any, token_ids: list[int]) -> str:
    """``tokenizer.decode(token_ids)``, through the Rust tokenizer's batch call where there is
    one: that call releases the GIL (a single decode holds it for as long as it runs, about a
    second per million ids, stalling every other thread of the process)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.decode(token_ids)
    [text] = backend.decode_batch([token_ids], skip_special_tokens=False)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        text = tokenizer.clean_up_tokenization(text)
    return text


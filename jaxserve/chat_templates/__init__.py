"""Chat templates shipped with jaxserve: ``--chat-template NAME`` selects one by file name
(without ``.jinja``). Tool-aware variants of templates that ignore ``tools``."""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).parent

# SmolLM2-Instruct's own template (the default model's): it drops tools and tool calls.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# A model's own template -> the bundled tool-aware one served in its place when no
# --chat-template is given (it renders tool-free chats identically).
_TOOL_AWARE = {SMOLLM2_TEMPLATE: "smollm2_tools"}


def bundled_names() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.jinja"))


def bundled_template(name: str) -> str | None:
    """The bundled template called ``name`` (None if there is none)."""
    path = _DIR / f"{name.removesuffix('.jinja')}.jinja"
    return path.read_text() if path.is_file() and path.parent == _DIR else None


def tool_aware_replacement(template: str | None) -> str | None:
    """The bundled tool-aware variant of a model's own template, if jaxserve has one."""
    name = _TOOL_AWARE.get((template or "").strip())
    return None if name is None else bundled_template(name)

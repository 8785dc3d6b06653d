"""``<think>...</think>`` reasoning (DeepSeek-R1 and its distills, Qwen3, QwQ).

``split(text, final)`` takes the output so far and returns (reasoning, content), each
only growing as the text grows (so streamed deltas reassemble to the full response);
while streaming, a tail that may be the start of ``</think>`` is held back.

Where the thinking starts depends on the chat template, so the prompt decides:

* prompt ends with ``<think>`` (R1 distills, Qwen3-Thinking-2507): the output starts
  inside the thinking;
* prompt ends with ``</think>`` (Qwen3 with ``enable_thinking: false``): no thinking,
  everything is content;
* otherwise ``deepseek_r1`` assumes thinking (R1 often omits the opening tag), and
  ``qwen3`` thinks only if the output opens with ``<think>``.

Output that never closes its thinking (cut by max_tokens) is all reasoning, no content.
"""

from __future__ import annotations


def _held_back(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    name = ""
    start_token = "<think>"
    end_token = "</think>"
    thinks_by_default = True          # without a tag in prompt or output

    def __init__(self, prompt_text: str = "") -> None:
        tail = prompt_text.rstrip()
        self.starts_thinking = tail.endswith(self.start_token)
        self.thinking_disabled = tail.endswith(self.end_token)

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None when there is none, content) of the output so far."""
        if self.thinking_disabled:
            return None, text
        body = text
        stripped = text.lstrip()
        if not final and self.start_token.startswith(stripped):
            return None, ""                         # nothing yet, or a partial opening tag
        if stripped.startswith(self.start_token):
            body = stripped[len(self.start_token):]
        elif not self.starts_thinking and not self.thinks_by_default:
            return None, text
        end = body.find(self.end_token)
        if end < 0:
            keep = body if final else body[:len(body) - _held_back(body, self.end_token)]
            return keep, ""
        return body[:end], body[end + len(self.end_token):]


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    thinks_by_default = False

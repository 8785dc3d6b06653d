"""One choice's growing text → reasoning, content and tool calls, for chat and Responses.

The reasoning parser (``--reasoning-parser``) runs first; tool-call parsing sees only the
content after the reasoning (as vLLM). ``split`` reads a final text; ``deltas`` what is
new since its last call, from the same code, so streamed deltas reassemble to ``split``.
``feed`` takes the engine's DELTA outputs (only the new text) and keeps the text so far,
which the parsers need; plain text (no reasoning parser, no tools) passes straight through.
"""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan
from jaxserve.entrypoints.openai.tool_parsers import ParsedToolCall
from jaxserve.reasoning import ReasoningParser


class ChoiceOutput:

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolCallStream(plan) if plan is not None and plan.uses_tools else None
        self.reasoning = reasoning
        self.sent_reasoning = 0
        self.sent_content = 0
        self._pieces: list[str] = []

    def _reasoning_split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, final)

    def split(self, text: str, final: bool = True
              ) -> tuple[str | None, str, list[ParsedToolCall]]:
        """(reasoning or None, content, tool calls) of a whole text."""
        reasoning, content = self._reasoning_split(text, final)
        if self.tools is None:
            return reasoning, content, []
        content, calls = self.tools.split(content, final)
        return reasoning, content, calls

    def deltas(self, text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """(new reasoning, new content, new tool-call deltas in chat's chunk shape)."""
        reasoning, content = self._reasoning_split(text, final)
        reasoning = reasoning or ""
        new_reasoning = reasoning[self.sent_reasoning:]
        self.sent_reasoning = len(reasoning)
        if self.tools is None:
            new_content, calls = content[self.sent_content:], []
            self.sent_content = len(content)
        else:
            new_content, calls = self.tools.deltas(content, final)
        return new_reasoning, new_content, calls

    def feed(self, new_text: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """``deltas`` of the text so far plus ``new_text`` (one DELTA output's text)."""
        self._pieces.append(new_text)
        if self.tools is None and self.reasoning is None:
            self.sent_content += len(new_text)
            return "", new_text, []
        return self.deltas(self.text, final)

    @property
    def text(self) -> str:
        """All the text fed so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and bool(self.tools.ids)

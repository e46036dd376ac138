"""What a client sees of a task's decoded text: stop strings end it, tool calls are lifted out.

Text that could still turn into a stop string or a tool-call marker is held back until it is
known not to, so a stop string never reaches the client, even when it spans several tokens.
The matching itself is mlx-lm's character-level automaton (`TextStateMachine`): a stop string
is an edge into the terminal state, a tool-call marker an edge into the "tool" state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import TextStateMachine

NORMAL = "normal"
TOOL = "tool"

ToolParser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class ToolCallSyntax:
    start: str
    end: str | None  # None: the call runs to the end of the output
    parse: ToolParser
    tools: list[dict[str, Any]]


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON, as OpenAI sends it


class VisibleText:
    def __init__(self, stops: list[str], tool_calls: ToolCallSyntax | None) -> None:
        stop_edges: list[tuple[str, str | None]] = [(stop, None) for stop in stops if stop]
        transitions: dict[str, list[tuple[str, str | None]]] = {NORMAL: list(stop_edges)}
        if tool_calls is not None:
            transitions[NORMAL].append((tool_calls.start, TOOL))
            transitions[TOOL] = list(stop_edges)
            if tool_calls.end:
                transitions[TOOL].append((tool_calls.end, NORMAL))
        self._machine_state = TextStateMachine(transitions).make_state(NORMAL)
        self._syntax = tool_calls
        self._tool_text = ""
        self.stopped = False
        self.stop_sequence: str | None = None  # the stop string that ended the text
        self._stops = [stop for stop in stops if stop]
        self._pushed: list[str] = []  # every text pushed, to name the stop that matched
        self.tool_calls: list[ParsedToolCall] = []
        self.made_tool_call = False

    def push(self, text: str) -> str:
        """Take newly decoded text; return the part that is now safe to show."""
        if self.stopped or not text:
            return ""
        if self._stops:
            self._pushed.append(text)
        self._machine_state, segments = TextStateMachine.split(self._machine_state, text)
        shown = self._collect(segments)
        if self.stopped:
            self.stop_sequence = first_stop("".join(self._pushed), self._stops)
            self._pushed = []
        return shown

    def flush(self) -> str:
        """The output ended without a stop string: release what was held back."""
        if self.stopped:
            return ""
        self._machine_state, held, state = TextStateMachine.flush(self._machine_state)
        return self._collect([(state, held)]) + self._close_tool_call(ended=False)

    def take_tool_calls(self) -> list[ParsedToolCall]:
        calls, self.tool_calls = self.tool_calls, []
        return calls

    def _collect(self, segments: list[tuple[str | None, str]]) -> str:
        shown = []
        for state, text in segments:
            if state == TOOL:
                self._tool_text += text
                continue
            # Back to normal text means the end marker came; a stop string also ends the call.
            shown.append(self._close_tool_call(ended=state == NORMAL))
            if state is None:
                self.stopped = True
            else:
                shown.append(text)
        return "".join(shown)

    def _close_tool_call(self, ended: bool) -> str:
        """Parse the call just finished; text that does not parse is shown as it came."""
        if not self._tool_text or self._syntax is None:
            return ""
        body, self._tool_text = self._tool_text, ""
        try:
            parsed = self._syntax.parse(body, self._syntax.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            found = [_as_call(call) for call in calls]
        except (ValueError, TypeError, KeyError):
            end = self._syntax.end if ended and self._syntax.end else ""
            return f"{self._syntax.start}{body}{end}"
        self.tool_calls.extend(found)
        self.made_tool_call = True
        return ""


def _as_call(call: Any) -> ParsedToolCall:
    name = call["name"]
    arguments = call.get("arguments", {})
    if not isinstance(name, str):
        raise TypeError("a tool call's name must be a string")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(name=name, arguments=arguments)


def first_stop(text: str, stops: list[str]) -> str | None:
    """The stop string that ends first in `text` (the one the automaton stopped at: it stops
    at the first completed match); the longer one when two end at the same place. Pure."""
    ends = [(text.find(stop) + len(stop), -len(stop), stop) for stop in stops if stop in text]
    return min(ends)[2] if ends else None

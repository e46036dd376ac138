"""The grammar of a response format: JSON Schema compiled by llguidance, without mlx, so the
gateway can refuse a schema that cannot be compiled before anything is queued. A neutral
module (neither gateway nor runner): both use it, and the gateway never imports the runner.

The separators are fixed (", " and ": ") and no other whitespace is allowed: a small model
given free whitespace can spend its whole budget on newlines and never close the object.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llguidance import LLMatcher

from fleet.wire.tasks import NamedFunction, ResponseFormat, Tool, ToolChoice

JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_for(response_format: ResponseFormat) -> str | None:
    """The llguidance grammar of a response format; None for plain text. Raises ValueError
    naming what is wrong with a schema that cannot be compiled."""
    if response_format.type == "text":
        return None
    schema = response_format.json_schema if response_format.type == "json_schema" else None
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema or ANY_OBJECT, defaults=JSON_LAYOUT)
    except Exception as exc:  # a schema that is not even JSON-serialisable, among others
        raise ValueError(f"the JSON schema cannot be used: {exc}") from None
    if problem := LLMatcher.validate_grammar(grammar):
        raise ValueError(f"the JSON schema cannot be used: {problem}")
    return grammar


def tool_call_grammar(
    tools: list[Tool],
    choice: ToolChoice,
    markers: tuple[str, str],
    single_token: Callable[[str], int | None],
) -> str:
    """A grammar for tool calls written between the template's markers as JSON objects of a
    name and its arguments (the layout of mlx-lm's json_tools parser): one call of the named
    function, or one or more calls of any of `tools` when the choice is `required`."""
    chosen = [
        tool for tool in tools
        if not isinstance(choice, NamedFunction) or tool.function.name == choice.name
    ]
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in chosen
    ]
    schema = {"x-guidance": JSON_LAYOUT, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    start, end = (_literal(marker, single_token) for marker in markers)
    repeat = "call" if isinstance(choice, NamedFunction) else 'call ("\\n" call)*'
    grammar = LLMatcher.grammar_from_lark(
        f"start: {repeat}\n"
        f'call: {start} "\\n" body "\\n" {end}\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    if problem := LLMatcher.validate_grammar(grammar):
        raise ValueError(f"the tools' parameters cannot be used to force a call: {problem}")
    return grammar


def _literal(marker: str, single_token: Callable[[str], int | None]) -> str:
    """A marker that is one token of its own must be matched as that token, not as text."""
    token = single_token(marker)
    return f"<[{token}]>" if token is not None else json.dumps(marker)

"""The grammar of a response format: JSON Schema compiled by llguidance, without mlx, so the
gateway can refuse a schema that cannot be compiled before anything is queued.

The separators are fixed (", " and ": ") and no other whitespace is allowed: a small model
given free whitespace can spend its whole budget on newlines and never close the object.
"""

from __future__ import annotations

from typing import Any

from llguidance import LLMatcher

from fleet.wire.tasks import ResponseFormat

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

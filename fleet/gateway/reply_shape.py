"""The shape a chat reply must take, as OpenAI asks for it: `response_format` (JSON mode, a
JSON Schema) and `tool_choice` (a call required, or of one named function). Both become a
grammar the runner enforces token by token; one a runner could not compile is a 400 here,
before anything is queued."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from fleet.gateway.openai_base import InvalidParameter, OpenAIRequest
from fleet.grammar import grammar_for
from fleet.wire.tasks import ResponseFormat


class JsonSchemaIn(OpenAIRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormatIn(OpenAIRequest):
    # One model rather than a tagged union: a union's tag would show up in the `param` of
    # every error inside it. The document still says that json_schema goes with its type.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
    })

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormatIn:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class FunctionNameIn(OpenAIRequest):
    name: str


class ToolChoiceFunctionIn(OpenAIRequest):
    type: Literal["function"]
    function: FunctionNameIn


ToolChoiceIn = Literal["none", "auto", "required"] | ToolChoiceFunctionIn


def response_format_of(requested: ResponseFormatIn) -> ResponseFormat:
    """The task's response format, refused here (400) when its schema cannot be compiled,
    rather than by a runner after the request was queued."""
    schema = requested.json_schema.schema_ if requested.json_schema else None
    response_format = ResponseFormat(type=requested.type, json_schema=schema)
    try:
        grammar_for(response_format)
    except ValueError as exc:
        raise InvalidParameter(str(exc), "response_format") from None
    return response_format


def tool_choice_of(
    choice: ToolChoiceIn | None,
    tool_names: Sequence[str],
    response_format: ResponseFormatIn | None,
) -> str | dict[str, str] | None:
    """The task's tool choice (None: auto); a choice the tools cannot satisfy is a 400."""
    if choice in (None, "auto", "none"):
        return None
    names = list(tool_names)
    if not names:
        raise InvalidParameter("tool_choice: there are no tools to choose from", "tool_choice")
    if response_format and response_format.type != "text":
        raise InvalidParameter(
            "tool_choice: a forced tool call and a response_format cannot both shape the reply",
            "tool_choice",
        )
    if isinstance(choice, ToolChoiceFunctionIn):
        if choice.function.name not in names:
            raise InvalidParameter(
                f"tool_choice: {choice.function.name!r} is not one of the tools", "tool_choice"
            )
        return {"type": "function", "name": choice.function.name}
    return "required"

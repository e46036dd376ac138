"""What the client sees of decoded text: stop strings held back and cut, tool calls lifted out."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

# fleet.runner's modules are imported where used, not at the top: they import mlx-lm, which
# pulls in transformers (1.2 s of CPU), and collection imports this module in every xdist
# worker (issue 28).
if TYPE_CHECKING:
    from fleet.runner.visible_text import ToolCallSyntax, VisibleText


@pytest.fixture
def tool_syntax() -> ToolCallSyntax:
    from mlx_lm.tool_parsers import json_tools

    from fleet.runner.visible_text import ToolCallSyntax

    return ToolCallSyntax(
        start="<tool_call>", end="</tool_call>", parse=json_tools.parse_tool_call, tools=[]
    )


def feed(visible: VisibleText, pieces: list[str]) -> list[str]:
    return [visible.push(piece) for piece in pieces]


@pytest.mark.parametrize(
    ("pieces", "stops", "shown", "matched"),
    [
        (["Hello", " wor", "ld"], [], ["Hello", " wor", "ld"], None),
        # "wo" could begin "world": held until the stop string completes, then dropped.
        (["Hello", " wo", "rld", "!"], ["world"], ["Hello", " ", "", ""], "world"),
        # A partial match that fails is released with the text that broke it.
        (["Hello", " wo", "nder"], ["world"], ["Hello", " ", "wonder"], None),
        # The earliest of several stop strings wins; nothing after it is shown.
        (["a\n", "\nb END"], ["\n\n", "END"], ["a", ""], "\n\n"),
        (["a END", "\n\n"], ["\n\n", "END"], ["a ", ""], "END"),
    ],
)
def test_stop_strings(pieces: list[str], stops: list[str], shown: list[str],
                      matched: str | None) -> None:
    from fleet.runner.visible_text import VisibleText
    visible = VisibleText(stops, tool_calls=None)
    assert feed(visible, pieces) == shown
    assert visible.stopped is (matched is not None)
    assert visible.stop_sequence == matched


@pytest.mark.parametrize(
    ("text", "stops", "first"),
    [
        ("abc", ["x"], None),
        ("xx END yy STOP", ["STOP", "END"], "END"),
        ("xab", ["b", "ab"], "ab"),  # both end at once: the longer one is the match
        ("", ["a"], None),
    ],
)
def test_first_stop(text: str, stops: list[str], first: str | None) -> None:
    from fleet.runner.visible_text import first_stop
    assert first_stop(text, stops) == first


def test_flush_releases_a_partial_stop_string_when_the_output_ends() -> None:
    from fleet.runner.visible_text import VisibleText
    visible = VisibleText(["world"], tool_calls=None)
    assert feed(visible, ["Hello wor"]) == ["Hello "]
    assert visible.flush() == "wor"


def test_tool_calls_are_parsed_out_of_the_text(tool_syntax: ToolCallSyntax) -> None:
    from fleet.runner.visible_text import ParsedToolCall, VisibleText
    visible = VisibleText([], tool_calls=tool_syntax)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    body = json.dumps(call)
    shown = feed(visible, ["Sure. <tool", "_call>", body[:10], body[10:], "</tool_call>", " ok"])
    assert "".join(shown) == "Sure.  ok"
    assert visible.take_tool_calls() == [
        ParsedToolCall(name="get_weather", arguments=json.dumps({"city": "Paris"}))
    ]
    assert visible.made_tool_call
    assert visible.take_tool_calls() == []


def test_a_tool_call_that_does_not_parse_is_shown_as_text(tool_syntax: ToolCallSyntax) -> None:
    from fleet.runner.visible_text import VisibleText
    visible = VisibleText([], tool_calls=tool_syntax)
    shown = feed(visible, ["<tool_call>", "not json", "</tool_call>"])
    assert "".join(shown) == "<tool_call>not json</tool_call>"
    assert not visible.made_tool_call


def test_an_unfinished_tool_call_is_shown_when_the_output_ends(tool_syntax: ToolCallSyntax) -> None:
    from fleet.runner.visible_text import VisibleText
    visible = VisibleText([], tool_calls=tool_syntax)
    assert feed(visible, ["<tool_call>", '{"name": "f"']) == ["", ""]
    assert visible.flush() == '<tool_call>{"name": "f"'

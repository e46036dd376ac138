"""One text task turning decoded tokens into events, fed the tokens a decoder would hand over.

Random weights never write multi-byte text or a tool call, so these tokens come from the
tokenizer instead of the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from fleet.runner.engine import EngineEvent, Token
from fleet.wire.events import TaskFinished, TokenChunk, ToolCallChunk
from fleet.wire.tasks import TextGeneration

# mlx-lm and fleet.runner's modules are imported where used, not at the top: mlx-lm, which they
# import, pulls in transformers (1.2 s of CPU), and collection imports this module in every xdist
# worker (issue 28).
if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from fleet.runner.visible_text import VisibleText

EOS = 2  # <|im_end|> in tiny-llm's vocabulary


@pytest.fixture(scope="module")
def tokenizer(tiny_llm_dir: Path) -> TokenizerWrapper:
    from mlx_lm.utils import load_tokenizer
    return load_tokenizer(tiny_llm_dir)


def feed(
    tokenizer: TokenizerWrapper, visible: VisibleText | None, tokens: list[int], **task: Any
) -> list[EngineEvent]:
    """Give a task `tokens` and then EOS; return every event it made."""
    from mlx_lm.generate import GenerationBatch

    from fleet.runner.text_task import TextTask
    state = TextTask(
        task=TextGeneration(task_id="t", model="tiny-llm", prompt="hi", **task),
        detokenizer=tokenizer.detokenizer,
        token_text=lambda token: tokenizer.decode([token]),
        visible=visible,
        prompt_tokens=3,
        cached_tokens=0,
        system_end=0,
        queue_wait_s=0.0,
        node_id="node",
        runner_id="runner",
    )
    events: list[EngineEvent] = []
    for position, token in enumerate([*tokens, EOS]):
        response = GenerationBatch.Response(
            uid=0,
            token=token,
            logprobs=None,
            finish_reason="stop" if token == EOS else None,
            prompt_cache=None,
            all_tokens=None,
        )
        state.on_token(response, at=0.0, now=float(position), events=events)
    assert isinstance(events[-1], TaskFinished)
    assert sum(isinstance(event, TaskFinished) for event in events) == 1
    return events


def chunks(events: list[EngineEvent]) -> list[TokenChunk]:
    """The token events, plain tokens as their TokenChunk."""
    return [event.chunk() if isinstance(event, Token) else event for event in events
            if isinstance(event, Token | TokenChunk)]


def test_multibyte_characters_come_out_whole(tokenizer: TokenizerWrapper) -> None:
    text = "Héllo wörld, 你好 ✓ done"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text.split())  # byte-level pieces, split inside characters
    events = feed(tokenizer, None, tokens)
    assert "".join(chunk.text for chunk in chunks(events)) == text
    assert not any("\ufffd" in chunk.text for chunk in chunks(events))
    assert [chunk.index for chunk in chunks(events)] == list(range(len(tokens) + 1))


def test_a_generated_tool_call_becomes_a_tool_call_chunk(tokenizer: TokenizerWrapper) -> None:
    from fleet.runner.visible_text import ToolCallSyntax, VisibleText
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    syntax = ToolCallSyntax(
        start=tokenizer.tool_call_start,
        end=tokenizer.tool_call_end,
        parse=tokenizer.tool_parser,
        tools=[tool],
    )
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    tokens = tokenizer.encode("Let me look. " + call, add_special_tokens=False)
    events = feed(tokenizer, VisibleText([], syntax), tokens, tools=[tool])

    assert "".join(chunk.text for chunk in chunks(events)) == "Let me look. "
    calls = [event for event in events if isinstance(event, ToolCallChunk)]
    assert [(call.index, call.name, call.arguments) for call in calls] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    finished = events[-1]
    assert isinstance(finished, TaskFinished)
    assert finished.finish_reason == "tool_calls"
    assert finished.usage is not None and finished.usage.completion_tokens == len(tokens) + 1

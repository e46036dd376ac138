"""Everything decided about a text task before it decodes, or the reason it will not.

The prompt is tokenized and checked against the context; the sampler, the logits processors
and the filter of the visible text are built; the longest cached prefix is looked up, and the
rest of the prompt is split at the end of the system prompt so that prefill pauses there and
the system prompt's KV cache can be kept for the tasks after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlx_lm.tokenizer_utils import TokenizerWrapper

from fleet.errors import TaskRejected
from fleet.runner.chat_prompt import build_prompt
from fleet.runner.prefix_cache import PrefixCache
from fleet.runner.sampling import make_task_processors, make_task_sampler
from fleet.runner.solo import SequenceSpec
from fleet.runner.structured import StructuredOutput
from fleet.runner.visible_text import ToolCallSyntax, VisibleText
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import TextGeneration


@dataclass(frozen=True)
class PreparedTask:
    spec: SequenceSpec
    prompt_tokens: int
    cached_tokens: int
    system_end: int  # where the system prompt's KV cache is to be stored; 0 for nowhere
    visible: VisibleText | None  # None: every decoded character is shown as it comes


def prepare_task(
    task: TextGeneration,
    tokenizer: TokenizerWrapper,
    *,
    context_length: int,
    vocab_size: int,
    prefix_cache: PrefixCache | None,
    structured: StructuredOutput | None = None,
    generated: Sequence[int] = (),
) -> PreparedTask:
    """`generated`: the completion tokens a continued task already streamed. They are
    prefilled after the prompt, and sampling, penalties and grammar resume at their end."""
    prompt = build_prompt(tokenizer, task)
    prompt_length = len(prompt.tokens)
    tokens = [*prompt.tokens, *generated]
    if len(tokens) >= context_length:
        raise TaskRejected(
            ErrorReason.CONTEXT_LENGTH,
            f"the prompt is {prompt_length} tokens but this model's context holds "
            f"{context_length}, the prompt and at least one new token",
        )
    sampler = make_task_sampler(task, vocab_size, len(generated))
    processors = make_task_processors(task, vocab_size, prompt_length)
    if structured is not None and (mask := structured.mask_for(task, generated)):
        processors = [*processors, mask]  # last: no bias can bring back a masked token

    cache, cached = None, 0
    system_end = 0
    if prefix_cache is not None:
        cache, cached = prefix_cache.lookup(tokens)
        system_end = prompt.system_end
    if system_end > cached:
        segments = [tokens[cached:system_end], tokens[system_end:]]
    else:
        segments, system_end = [tokens[cached:]], 0
    spec = SequenceSpec(
        segments=segments,
        cache=cache,
        cached_tokens=tokens[:cached],
        sampler=sampler,
        processors=processors,
        # Generation ends at the end of the context, with finish_reason "length".
        max_tokens=min(task.max_tokens, context_length - prompt_length) - len(generated),
    )
    return PreparedTask(
        spec=spec,
        prompt_tokens=prompt_length,
        cached_tokens=cached,
        system_end=system_end,
        visible=_visible_text(task, tokenizer),
    )


def _visible_text(task: TextGeneration, tokenizer: TokenizerWrapper) -> VisibleText | None:
    tool_syntax = None
    if task.tools and tokenizer.has_tool_calling:
        tool_syntax = ToolCallSyntax(
            start=tokenizer.tool_call_start,
            end=tokenizer.tool_call_end or None,
            parse=tokenizer.tool_parser,
            tools=[tool.model_dump(exclude_none=True) for tool in task.tools],
        )
    if not task.stop and tool_syntax is None:
        return None
    return VisibleText(task.stop, tool_syntax)

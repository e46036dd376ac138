"""One admitted text task: its detokenizer, its visible text, its counters and timings.

`on_token` turns one token from the batch generator into events: a Token (a TokenChunk when
logprobs are asked for) for every generated token (the end-of-sequence token included, with no
text of its own), the tool calls completed by it, and the TaskFinished when it is the last.
Usage counts exactly the tokens emitted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import numpy as np
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from fleet.runner.engine import EngineEvent, Token
from fleet.runner.visible_text import VisibleText
from fleet.wire.events import (
    ErrorReason,
    TaskFinished,
    TaskStats,
    TokenChunk,
    ToolCallChunk,
    TopLogprob,
    Usage,
)
from fleet.wire.tasks import TextGeneration

FinishReason = Literal["stop", "length", "tool_calls"]


class TextTask:
    def __init__(
        self,
        *,
        task: TextGeneration,
        detokenizer: StreamingDetokenizer,
        token_text: Callable[[int], str],
        visible: VisibleText | None,
        prompt_tokens: int,
        cached_tokens: int,
        system_end: int,
        queue_wait_s: float,
        node_id: str,
        runner_id: str,
        generated: Sequence[int] = (),
    ) -> None:
        """`generated`: the tokens a continued task already streamed (its earlier attempts).
        They are replayed through the detokenizer and the visible-text filter, so the next
        token's text, held-back stop-string prefixes and tool calls resume exactly; indexes
        and usage count on from them."""
        self.task = task
        self.system_end = system_end  # > 0 while its system prompt is still to be cached
        self.batched_with = 0
        self._detokenizer = detokenizer
        self._token_text = token_text
        self._visible = visible
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens
        self._queue_wait_s = queue_wait_s
        self._node_id = node_id
        self._runner_id = runner_id
        self._admitted_at = time.perf_counter()
        self._first_token_at: float | None = None
        self._last_token_at = 0.0
        self._emitted = 0
        self._tool_calls = 0
        self.ended_before = self._replay(generated)

    def _replay(self, generated: Sequence[int]) -> bool:
        """Replay earlier tokens without emitting them; True when they had already ended the
        text (a stop string), so the continued task finishes without a new token."""
        for token in generated:
            self._detokenizer.add_token(token)
        text = self._detokenizer.last_segment
        self._emitted = len(generated)
        if self._visible is None:
            return False
        self._visible.push(text)
        self._tool_calls = len(self._visible.take_tool_calls())  # streamed before the seam
        return self._visible.stopped

    def finish_now(self, at: float, now: float, finish_reason: FinishReason) -> TaskFinished:
        """A continued task whose earlier tokens already ended it (the previous attempt died
        between its last token and its terminal): the terminal alone."""
        return TaskFinished(
            task_id=self.task.task_id, at=at, status="completed", finish_reason=finish_reason,
            stop_sequence=self._visible.stop_sequence if self._visible is not None else None,
            usage=self._usage(), stats=self._stats(now),
            node_id=self._node_id, runner_id=self._runner_id,
        )

    def on_token(
        self, response: Any, at: float, now: float, events: list[EngineEvent]
    ) -> TaskFinished | None:
        """Add the events of one generated token; return the TaskFinished if it ended the task."""
        token: int = response.token
        finish_reason = cast(FinishReason | None, response.finish_reason)
        # The decoders stop on end-of-sequence tokens alone, and those have no text to show.
        if finish_reason != "stop":
            self._detokenizer.add_token(token)
        if finish_reason is not None:
            self._detokenizer.finalize()
        text = self._detokenizer.last_segment
        if self._visible is not None:
            text = self._visible.push(text)
            if self._visible.stopped:
                finish_reason = "stop"
            elif finish_reason is not None:
                text += self._visible.flush()

        if self._first_token_at is None:
            self._first_token_at = now
        self._last_token_at = now
        if self.task.logprobs or self.task.top_logprobs:
            logprob, top = self._logprobs(token, response.logprobs)
            events.append(
                TokenChunk(
                    task_id=self.task.task_id,
                    at=at,
                    index=self._emitted,
                    token_id=token,
                    text=text,
                    logprob=logprob,
                    top_logprobs=top,
                )
            )
        else:
            events.append(Token(self.task.task_id, at, self._emitted, token, text))
        self._emitted += 1
        if self._visible is not None and self._visible.tool_calls:
            self._add_tool_calls(self._visible, at, events)
        if finish_reason is None:
            return None
        if finish_reason == "stop" and self._visible is not None and self._visible.made_tool_call:
            finish_reason = "tool_calls"
        finished = TaskFinished(
            task_id=self.task.task_id,
            at=at,
            status="completed",
            finish_reason=finish_reason,
            stop_sequence=self._visible.stop_sequence if self._visible is not None else None,
            usage=self._usage(),
            stats=self._stats(now),
            node_id=self._node_id,
            runner_id=self._runner_id,
        )
        events.append(finished)
        return finished

    def cancelled(self, at: float, now: float) -> TaskFinished:
        return TaskFinished(
            task_id=self.task.task_id,
            at=at,
            status="cancelled",
            reason=ErrorReason.CANCELLED,
            message="cancelled while generating",
            usage=self._usage(),
            stats=self._stats(now),
            node_id=self._node_id,
            runner_id=self._runner_id,
        )

    def _logprobs(self, token: int, row: Any) -> tuple[float, list[TopLogprob] | None]:
        # The row is already evaluated: numpy reads it without another trip through mlx.
        logprobs = np.asarray(row).reshape(-1)
        top: list[TopLogprob] | None = None
        if self.task.top_logprobs:
            count = min(self.task.top_logprobs, logprobs.shape[-1])
            best = np.argpartition(-logprobs, count - 1)[:count]
            best = best[np.argsort(-logprobs[best])]
            top = [
                TopLogprob(token=self._token_text(i), token_id=i, logprob=float(logprobs[i]))
                for i in best.tolist()
            ]
        return float(logprobs[token]), top

    def _add_tool_calls(self, visible: VisibleText, at: float, events: list[EngineEvent]) -> None:
        for call in visible.take_tool_calls():
            events.append(
                ToolCallChunk(
                    task_id=self.task.task_id,
                    at=at,
                    index=self._tool_calls,
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            self._tool_calls += 1

    def _usage(self) -> Usage:
        return Usage(
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._emitted,
            total_tokens=self._prompt_tokens + self._emitted,
            cached_tokens=self._cached_tokens,
        )

    def _stats(self, now: float) -> TaskStats:
        first = self._first_token_at
        time_to_first_token = None if first is None else first - self._admitted_at
        prompt_rate = None
        if time_to_first_token:
            prompt_rate = (self._prompt_tokens - self._cached_tokens) / time_to_first_token
        decode_rate = None
        if first is not None and self._emitted > 1 and self._last_token_at > first:
            decode_rate = (self._emitted - 1) / (self._last_token_at - first)
        return TaskStats(
            queue_wait_s=self._queue_wait_s,
            time_to_first_token_s=time_to_first_token,
            tokens_per_s=decode_rate,
            prompt_tokens_per_s=prompt_rate,
            total_s=now - self._admitted_at,
            batched_with=self.batched_with,
        )

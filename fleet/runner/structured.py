"""Structured output: JSON mode and JSON Schema, enforced token by token with llguidance.

Each constrained task gets a matcher compiled from its schema. Before every sampling step
the matcher's mask sets the logits of every token that would break the grammar to -inf;
once the value is complete only end-of-sequence is left, so the task ends with "stop".

The mask needs the token the previous step sampled, so a constrained sequence waits for it
(`.item()`) instead of letting mlx compute the next step ahead: constrained decoding trades
that overlap for correctness, and only the batches it is in pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from fleet.errors import TaskRejected
from fleet.grammar import grammar_for, tool_call_grammar
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import TextGeneration

# mlx-lm's parser for calls written as JSON between two markers: the one layout forced here.
JSON_TOOL_PARSER = "mlx_lm.tool_parsers.json_tools"


class GrammarMask:
    """A logits processor that keeps a sequence inside its grammar (one per task)."""

    def __init__(self, matcher: LLMatcher, end_tokens: set[int]) -> None:
        self._matcher = matcher
        self._end_tokens = sorted(end_tokens)
        self._calls = 0

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        # The first call comes with the prompt's last token; each later one with the token
        # sampled by the call before it, which the matcher has to take first.
        if self._calls:
            self._matcher.consume_token(int(context[-1].item()))
        self._calls += 1
        allowed = self._allowed(logits.shape[-1])
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _allowed(self, vocab: int) -> np.ndarray:
        allowed = np.zeros(vocab, dtype=np.bool_)
        if self._matcher.is_stopped() or self._matcher.is_error():
            # Complete, or in error (a token outside the mask, which sampling cannot pick):
            # either way only the end of the sequence is left.
            allowed[[t for t in self._end_tokens if t < vocab]] = True
            return allowed
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        words = np.unpackbits(bits, bitorder="little").astype(np.bool_)
        shared = min(vocab, words.size)
        allowed[:shared] = words[:shared]
        return allowed


class StructuredOutput:
    """Builds each constrained task's mask; the tokenizer's conversion (~0.6 s for a 49k
    vocabulary) is done once per runner, on the first task that asks for it."""

    def __init__(self, tokenizer: Any, end_tokens: set[int]) -> None:
        self._wrapper = tokenizer  # mlx-lm's TokenizerWrapper: template facts and the HF one
        self._hf_tokenizer = tokenizer._tokenizer
        self._end_tokens = end_tokens
        self._tokenizer: LLTokenizer | None = None

    def mask_for(
        self, task: TextGeneration, generated: Sequence[int] = ()
    ) -> GrammarMask | None:
        """`generated`: tokens a continued task already produced, replayed through the
        matcher before its first step so the grammar resumes where the stream stopped."""
        try:
            grammar = self._grammar(task)
        except ValueError as exc:
            raise TaskRejected(ErrorReason.INVALID_TASK, str(exc)) from None
        if grammar is None:
            return None
        matcher = LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise TaskRejected(
                ErrorReason.INVALID_TASK, f"the JSON schema cannot be used: {matcher.get_error()}"
            )
        if generated and not matcher.consume_tokens(list(generated)):
            raise TaskRejected(
                ErrorReason.INTERNAL,
                f"the generated tokens do not replay in the grammar: {matcher.get_error()}",
            )
        return GrammarMask(matcher, self._end_tokens)

    def _grammar(self, task: TextGeneration) -> str | None:
        if task.response_format is not None:
            return grammar_for(task.response_format)
        if task.tool_choice == "auto" or not task.tools:
            return None
        wrapper = self._wrapper
        parser = getattr(wrapper.tool_parser, "__module__", None)
        if not wrapper.has_tool_calling or parser != JSON_TOOL_PARSER:
            raise TaskRejected(
                ErrorReason.UNSUPPORTED,
                "this model's chat template has no JSON tool-call format that a tool_choice "
                "other than auto could enforce",
            )
        markers = (wrapper.tool_call_start, wrapper.tool_call_end)
        return tool_call_grammar(task.tools, task.tool_choice, markers, self._single_token)

    def _single_token(self, text: str) -> int | None:
        ids = self._hf_tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _llguidance_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, eos_token=min(self._end_tokens)
            )
        return self._tokenizer

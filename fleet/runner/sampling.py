"""Per-task sampling for the text engine: a sampler and logits processors built once per task.

Each sampled task draws token i from a PRNG key that is a pure function of (seed, i), so its
tokens depend on its seed and its prompt alone: not on which other tasks share the batch, on
the order in which they were admitted, or on whether the task was interrupted and continued
from token i on another runner (fleet.worker.continuation). mlx's global random state would
interleave the draws of every task in the batch. Greedy tasks all share mlx-lm's one greedy
sampler, which lets the batch generator sample an all-greedy batch in a single call.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from fleet.errors import TaskRejected
from fleet.wire.events import ErrorReason
from fleet.wire.tasks import TextGeneration

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class KeyedSampler:
    """Temperature sampling with optional top-p, min-p and top-k filters, from its own key."""

    def __init__(self, task: TextGeneration, vocab_size: int, start_index: int = 0) -> None:
        self._seed = task.seed if task.seed is not None else secrets.randbits(63)
        self._index = start_index  # the completion index of the next token drawn
        self._inverse_temperature = 1.0 / task.temperature
        self._filters: list[Callable[[mx.array], mx.array]] = []
        if task.top_p < 1.0:
            top_p = task.top_p
            self._filters.append(lambda logprobs: apply_top_p(logprobs, top_p))
        if task.min_p > 0.0:
            min_p = task.min_p
            self._filters.append(lambda logprobs: apply_min_p(logprobs, min_p))
        # A top-k that keeps the whole vocabulary filters nothing (and mlx-lm refuses it).
        if 0 < task.top_k < vocab_size:
            top_k = task.top_k
            self._filters.append(lambda logprobs: apply_top_k(logprobs, top_k))

    def __call__(self, logprobs: mx.array) -> mx.array:
        draw_key = mx.random.key(token_seed(self._seed, self._index))
        self._index += 1
        for keep_likely in self._filters:
            logprobs = keep_likely(logprobs)
        return mx.random.categorical(logprobs * self._inverse_temperature, key=draw_key)


_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The PRNG seed of completion token `index`: splitmix64 of (seed, index), so draws for
    neighbouring indexes (or seeds) are unrelated, and any index can be drawn first."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def make_task_sampler(task: TextGeneration, vocab_size: int, start_index: int = 0) -> Sampler:
    """`start_index`: how many completion tokens were generated before (a continued task)."""
    if task.temperature == 0.0:
        return greedy_sampler
    return KeyedSampler(task, vocab_size, start_index)


def make_task_processors(
    task: TextGeneration, vocab_size: int, completion_starts: int | None = None
) -> list[LogitsProcessor]:
    """`completion_starts`: the prompt's length in tokens. A continued task is prefilled with
    prompt + generated tokens, so only the prompt's length says where its completion began."""
    processors: list[LogitsProcessor] = []
    if task.logit_bias:
        outside = sorted(token for token in task.logit_bias if not 0 <= token < vocab_size)
        if outside:
            raise TaskRejected(
                ErrorReason.INVALID_TASK,
                f"logit_bias names token ids outside the vocabulary (0..{vocab_size - 1}): "
                f"{outside[:8]}",
            )
    processors += make_logits_processors(
        logit_bias=task.logit_bias, repetition_penalty=task.repetition_penalty
    )
    if task.presence_penalty or task.frequency_penalty:
        processors.append(CompletionPenalties(
            task.presence_penalty, task.frequency_penalty, completion_starts
        ))
    return processors


class CompletionPenalties:
    """OpenAI's presence and frequency penalties, counted over the tokens this task generated.

    mlx-lm's own versions count the last N tokens of the whole context, prompt included; OpenAI
    and vLLM count the completion only. Both decoding paths (alone and in the batch) hand a
    processor the whole context, prompt first, one token longer per step, so the length seen
    at the first step is where the completion begins.
    """

    def __init__(
        self, presence: float, frequency: float, completion_starts: int | None = None
    ) -> None:
        self._presence = presence
        self._frequency = frequency
        self._completion_starts = completion_starts

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if self._completion_starts is None:
            self._completion_starts = context.size
        completion = context[self._completion_starts:]
        if completion.size == 0:
            return logits
        uses = mx.zeros((logits.shape[-1],), dtype=logits.dtype).at[completion].add(1.0)
        penalty = self._frequency * uses + self._presence * (uses > 0)
        return logits - penalty.astype(logits.dtype)

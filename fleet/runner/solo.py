"""A task alone on the runner decodes outside the batch generator, as mlx-lm's generate_step does.

With one sequence, the batch generator's bookkeeping (a padded batch cache with its attention
mask, per-row splits of the logits, batch filtering) costs a measurable share of each decode
step on small models, which would leave a lone task slower than in-process mlx-lm. A lone task
therefore runs on a plain KV cache with the same one-step lookahead as generate_step. When a
second task arrives, `hand_off` gives back everything the batch generator needs to carry on:
the KV cache, the tokens in it, the sampler (its PRNG key continues where it was) and the
tokens still to feed. The tokens come out the same either way.

It answers `next`, `extract_cache` and `remove` like the batch generator, for one uid.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, generation_stream
from mlx_lm.models.cache import KVCache, TokenBuffer, make_prompt_cache

from fleet.runner.prefill_ramp import chunk_tokens
from fleet.runner.sampling import LogitsProcessor, Sampler


@dataclass
class SequenceSpec:
    """One sequence to decode: what `BatchGenerator.insert_segments` takes for it."""

    segments: list[list[int]]  # tokens still to feed; the system prompt its own segment
    cache: list[Any] | None  # per-layer KV cache holding `cached_tokens`, or None for empty
    cached_tokens: list[int]
    sampler: Sampler
    processors: list[LogitsProcessor]
    max_tokens: int


class SoloSequence:
    def __init__(
        self,
        model: Any,
        uid: int,
        spec: SequenceSpec,
        stop_tokens: set[int],
        prefill_step: int,
        first_chunk: int | None = None,
    ) -> None:
        """`first_chunk`: read the prompt in a ramp from this many tokens (prefill_ramp.py);
        None reads it in steps of `prefill_step`."""
        self.uid = uid
        self._model = model
        self._spec = spec
        self._stop_tokens = stop_tokens
        self._prefill_step = prefill_step
        self._first_chunk = prefill_step if first_chunk is None else first_chunk
        self._segments = [list(segment) for segment in spec.segments if segment]
        # Like generate_step, the last prompt token is fed by the first decode step.
        self._last_prompt_token = self._segments[-1].pop()
        if not self._segments[-1]:
            self._segments.pop()
        self.cache = spec.cache if spec.cache is not None else make_prompt_cache(model)
        self.tokens = list(spec.cached_tokens)  # exactly the tokens whose KV is in the cache
        self._context = TokenBuffer(self.tokens) if spec.processors else None
        self._prompt_total = sum(len(segment) for segment in self._segments) + 1
        self._prompt_done = 0
        self._generated = 0
        self._ahead: tuple[mx.array, mx.array] | None = None  # next token, being computed

    def next(self, look_ahead: bool = True) -> tuple[list[Any], list[Any]]:
        """Read a chunk of the prompt, or decode one token; the first token comes in the same
        call as the end of the prompt, as with generate_step."""
        with mx.stream(generation_stream):
            read = [self._prefill_chunk()] if self._segments else []
            if self._segments:
                return read, []
            return read, [self._decode(look_ahead)]

    @property
    def decoding(self) -> bool:
        return not self._segments

    @property
    def untouched(self) -> bool:
        """Nothing read or decoded yet: handing it off now is handing off its spec."""
        return self._prompt_done == 0 and self._segments != []

    def hand_off(self, next_token: int | None) -> SequenceSpec:
        """What is left of this sequence, for the batch generator; `next_token` is the last
        token returned, not yet fed (None while the prompt is still being read)."""
        if next_token is not None:
            rest = [[next_token]]
        else:
            rest = [*self._segments, [self._last_prompt_token]]
        return SequenceSpec(
            segments=rest,
            cache=self.cache,
            cached_tokens=self.tokens,
            sampler=self._spec.sampler,
            processors=self._spec.processors,
            max_tokens=self._spec.max_tokens - self._generated,
        )

    def extract_cache(self, uids: list[int]) -> dict[int, tuple[list[Any], list[int]]]:
        if self.uid not in uids:
            return {}
        # Later steps write into this cache, so the snapshot takes views up to now.
        return {self.uid: ([_snapshot(layer) for layer in self.cache], list(self.tokens))}

    def remove(
        self, uids: list[int], return_prompt_caches: bool = False
    ) -> dict[int, tuple[list[Any], list[int]]]:
        if self.uid not in uids or not return_prompt_caches:
            return {}
        return {self.uid: (self.cache, self.tokens)}

    def _prefill_chunk(self) -> Any:
        segment = self._segments[0]
        size = chunk_tokens(self._prompt_done, self._first_chunk, self._prefill_step)
        chunk, segment[:] = segment[:size], segment[size:]
        inputs = mx.array(chunk)
        self._model(inputs[None], cache=self.cache)
        mx.eval([layer.state for layer in self.cache])
        self.tokens.extend(chunk)
        if self._context is not None:
            self._context.update_and_fetch(inputs)
        self._prompt_done += len(chunk)
        if not segment:
            self._segments.pop(0)
        return PromptProcessingBatch.Response(
            self.uid, (self._prompt_done, self._prompt_total), not segment, False
        )

    def _decode(self, look_ahead: bool) -> Any:
        if self._ahead is None:
            self.tokens.append(self._last_prompt_token)
            self._ahead = self._forward(mx.array([self._last_prompt_token]))
        token_array, logprobs = self._ahead
        self._generated += 1
        self._ahead = None
        feeds = look_ahead and self._generated < self._spec.max_tokens
        if feeds:
            # Queue the next step before waiting for this token, as generate_step does.
            self._ahead = self._forward(token_array)
        token = token_array.item()
        if feeds:
            self.tokens.append(token)
        finish_reason = None
        if self._generated >= self._spec.max_tokens:
            finish_reason = "length"
        if token in self._stop_tokens:
            finish_reason = "stop"
        ended = finish_reason is not None
        return GenerationBatch.Response(
            uid=self.uid,
            token=token,
            logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_cache=self.cache if ended else None,
            all_tokens=self.tokens if ended else None,
        )

    def _forward(self, inputs: mx.array) -> tuple[mx.array, mx.array]:
        """Feed one token (lazily: it may still be being sampled) and sample the next."""
        logits = self._model(inputs[None], cache=self.cache)[:, -1, :]
        if self._context is not None:
            context = self._context.update_and_fetch(inputs)
            for processor in self._spec.processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self._spec.sampler(logprobs)
        mx.async_eval(sampled, logprobs)
        return sampled, logprobs


def _snapshot(layer: Any) -> Any:
    if not isinstance(layer, KVCache) or layer.keys is None:
        return copy.deepcopy(layer)
    # Slices up to the offset are new array objects: the cache's later in-place writes go to
    # its own arrays and leave the snapshot as it was.
    snapshot = KVCache()
    snapshot.keys = layer.keys[..., : layer.offset, :]
    snapshot.values = layer.values[..., : layer.offset, :]
    snapshot.offset = layer.offset
    return snapshot

"""The embedding engine: texts in, one pooled vector per text out, many requests per forward
pass (the runner kind of a card whose tasks include `embeddings`).

Micro-batching falls out of the runner's loop: every task that arrived while the previous
forward pass ran is admitted before the next `step()`, and a step packs the queued inputs of
all admitted tasks, oldest first, into one right-padded batch (fleet.runner.embed_pooling
says how many fit). The model is any mlx-lm text model: its inner transformer
(`model.model`) gives the final, normed hidden states, which the card's `embedding` spec pools
(mean over the real tokens, or the last one) and normalises.

Each step emits, per task, one `embedding` event per slice of vectors it computed (stamped
with the step's forward-pass number, so that anyone can count engine calls), and the terminal
of every task whose last input was in it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load as load_mlx_lm

from fleet.errors import TaskRejected
from fleet.runner.embed_pooling import (
    batch_size,
    encode_vectors,
    finish_vectors,
    per_event,
    pool,
)
from fleet.runner.engine import Admission, EngineConfig, Progress
from fleet.wire.events import (
    EmbeddingChunk,
    ErrorReason,
    OutputEvent,
    TaskFinished,
    TaskStats,
    Usage,
    failed,
)
from fleet.wire.tasks import Embeddings

log = logging.getLogger(__name__)

# Padded tokens in one forward pass, and texts: enough to batch hundreds of short requests,
# small enough that a pass of a 135M model on two CPU cores stays around a second.
BATCH_TOKENS = 4096
BATCH_ROWS = 256
# A pass waits this long after the first of its inputs arrived for others to join it (unless
# it is full): the tasks of a burst reach the runner one frame at a time, and a pass of a
# small model is shorter than the gaps between them.
LINGER_S = 0.005
LINGER_NAP_S = 0.0005


@dataclass
class _Job:
    """An admitted task: its inputs as token ids, and how far the forward passes got."""

    task: Embeddings
    tokens: list[list[int]]
    admitted_at: float
    queue_wait_s: float
    next_input: int = 0  # the first input no forward pass has taken yet
    done_inputs: int = 0
    batched_with: int = 0

    @property
    def waiting(self) -> int:
        return len(self.tokens) - self.next_input


@dataclass
class _Slice:
    job: _Job
    start: int
    count: int


@dataclass
class _Batch:
    slices: list[_Slice] = field(default_factory=list)

    @property
    def rows(self) -> list[list[int]]:
        return [row for s in self.slices for row in s.job.tokens[s.start:s.start + s.count]]


class EmbeddingEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = config.card.embedding_spec
        self.forward_passes = 0
        self._jobs: deque[_Job] = deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._context_length = config.card.context_length
        self._vocab_size = 0

    def load(self, progress: Progress) -> None:
        path = Path(self.config.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no mlx-lm model directory at {path}")
        model, tokenizer, model_config = load_mlx_lm(str(path), lazy=True, return_config=True)
        progress(0, 1)
        mx.eval(model.parameters())
        progress(1, 1)
        text_config = model_config.get("text_config", model_config)
        self._context_length = int(
            text_config.get("max_position_embeddings") or self.config.card.context_length
        )
        self._vocab_size = int(text_config.get("vocab_size") or len(tokenizer))
        self._body = model.model  # the transformer without its LM head: final hidden states
        self._tokenizer = tokenizer

    def warm_up(self) -> None:
        """One pass alone and one batched: the first request pays no first-call costs."""
        for texts in (["Hello"], ["Hello", "A longer warm-up text"]):
            self.forward([self.tokenize(text) for text in texts])

    def admit(self, admission: Admission) -> None:
        task = admission.task
        if not isinstance(task, Embeddings):
            raise TaskRejected(ErrorReason.UNSUPPORTED,
                               f"model {self.config.card.id} only makes embeddings")
        if why := self.spec.refuses_dimensions(task.dimensions):
            raise TaskRejected(ErrorReason.INVALID_TASK, why)
        tokens = [self._tokens(index, item, task.truncate)
                  for index, item in enumerate(task.input)]
        self._jobs.append(_Job(task, tokens, time.monotonic(), admission.queue_wait_s))

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def _tokens(self, index: int, item: str | list[int], truncate: bool) -> list[int]:
        if isinstance(item, str):
            ids = self.tokenize(item)
        else:
            ids = list(item)
            if bad := [token for token in ids if token >= self._vocab_size]:
                raise TaskRejected(ErrorReason.INVALID_TASK,
                                   f"input[{index}]: token {bad[0]} is not in the model's "
                                   f"vocabulary of {self._vocab_size}")
        if not ids:
            raise TaskRejected(ErrorReason.INVALID_TASK, f"input[{index}] has no tokens")
        if len(ids) > self._context_length and truncate:
            return ids[:self._context_length]
        if len(ids) > self._context_length:
            raise TaskRejected(ErrorReason.CONTEXT_LENGTH,
                               f"input[{index}] is {len(ids)} tokens, over the model's "
                               f"maximum of {self._context_length}")
        return ids

    def cancel(self, task_id: str) -> None:
        with self._lock:
            self._cancelled.add(task_id)

    @property
    def active(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        self._jobs.clear()

    def step(self) -> list[OutputEvent]:
        events: list[OutputEvent] = self._drop_cancelled()
        if self._lingering(time.monotonic()):
            time.sleep(LINGER_NAP_S)  # then the runner's loop takes in what arrived meanwhile
            return events
        batch = self._next_batch()
        if not batch.slices:
            return events
        vectors = self.forward(batch.rows)
        now = time.time()
        offset = 0
        for piece in batch.slices:
            job = piece.job
            job.batched_with = max(job.batched_with, len(batch.slices) - 1)
            mine = vectors[offset:offset + piece.count]
            offset += piece.count
            events += self._chunks(job, piece.start, mine, now)
            job.done_inputs += piece.count
            if job.done_inputs == len(job.tokens):
                self._jobs.remove(job)
                events.append(self._finished(job, now))
        return events

    def _lingering(self, now: float) -> bool:
        """Whether the next pass should wait for more inputs: its oldest arrived less than
        LINGER_S ago and it has room for more."""
        waiting = [job for job in self._jobs if job.waiting]
        if not waiting or sum(job.waiting for job in waiting) >= BATCH_ROWS:
            return False
        return now - min(job.admitted_at for job in waiting) < LINGER_S

    def _drop_cancelled(self) -> list[OutputEvent]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        gone = [job for job in self._jobs if job.task.task_id in cancelled]
        for job in gone:
            self._jobs.remove(job)
        return [failed(job.task.task_id, time.time(), ErrorReason.CANCELLED, "cancelled")
                for job in gone]

    def _next_batch(self) -> _Batch:
        """The oldest queued inputs that fit one pass (whole tasks' slices, in order)."""
        queued = [(job, index) for job in self._jobs
                  for index in range(job.next_input, len(job.tokens))]
        take = batch_size([len(job.tokens[i]) for job, i in queued], BATCH_TOKENS, BATCH_ROWS)
        batch = _Batch()
        for job, index in queued[:take]:
            if batch.slices and batch.slices[-1].job is job:
                batch.slices[-1].count += 1
            else:
                batch.slices.append(_Slice(job, index, 1))
        for piece in batch.slices:
            piece.job.next_input = piece.start + piece.count
        return batch

    def forward(self, rows: list[list[int]]) -> np.ndarray:
        """One forward pass over the distinct rows, right-padded; pooled, unnormalised
        vectors, one per row. A text repeated in a batch is computed once: its copies get
        the very same vector (a batch's rows can differ in their last bits with the BLAS)."""
        distinct: dict[tuple[int, ...], int] = {}
        places = [distinct.setdefault(tuple(row), len(distinct)) for row in rows]
        return self._pass([list(row) for row in distinct])[places]

    def _pass(self, rows: list[list[int]]) -> np.ndarray:
        self.forward_passes += 1
        lengths = [len(row) for row in rows]
        width = max(lengths)
        padded = mx.array([row + [0] * (width - len(row)) for row in rows], dtype=mx.int32)
        pooled = pool(self._body(padded), lengths, self.spec.pooling).astype(mx.float32)
        mx.eval(pooled)
        return np.array(pooled)

    def _chunks(self, job: _Job, start: int, raw: np.ndarray, now: float) -> list[OutputEvent]:
        task = job.task
        vectors = finish_vectors(raw, self.spec.normalize, task.dimensions)
        dimensions = vectors.shape[1]
        step = per_event(dimensions, task.encoding_format)
        return [
            EmbeddingChunk(
                task_id=task.task_id, at=now, index=start + first,
                encoding_format=task.encoding_format, dimensions=dimensions,
                embeddings=encode_vectors(vectors[first:first + step], task.encoding_format),
                forward_pass=self.forward_passes,
            )
            for first in range(0, len(vectors), step)
        ]

    def _finished(self, job: _Job, now: float) -> TaskFinished:
        tokens = sum(len(row) for row in job.tokens)
        return TaskFinished(
            task_id=job.task.task_id, at=now, status="completed", finish_reason="stop",
            usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
            stats=TaskStats(queue_wait_s=job.queue_wait_s,
                            total_s=time.monotonic() - job.admitted_at,
                            batched_with=job.batched_with),
        )

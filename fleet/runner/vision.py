"""The vision engine: chats with images on an mlx-vlm model (the runner kind of a card whose
tasks include `image_text_to_text`).

The worker has fetched and verified every image of a task before dispatch (Admission.inputs,
sha256 -> file), as for image edits; the engine turns the chat into a prompt with a run of
`<image>` placeholders per image (fleet.runner.vision_inputs) and the images into pixels, and
decodes. Each image's features
(vision tower and projector) come from the vision cache when any node encoded the image for this
model before (fleet.runner.vision_cache), else are encoded here and kept.

Greedy tasks decode together (continuous batching): their prompt with the image features
merged in is one row of input embeddings for mlx-vlm's BatchGenerator over the language
model, which prefills a newcomer while the others decode and steps every row in one forward.
Its sampler is one for the whole batch, so a task that samples (temperature, penalties, logit
bias) decodes on its own with mlx-vlm's generation step, one token per `step()`, beside the
batch. Every task ends with exactly one TaskFinished, as the text engine's do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.bus.vision_layout import features_dir
from fleet.errors import TaskRejected
from fleet.runner.engine import Admission, EngineConfig, Progress
from fleet.runner.visible_text import VisibleText
from fleet.runner.vision_cache import (
    EncodeHook,
    EncodeTiming,
    VisionCache,
    budget_bytes,
    fingerprint,
)
from fleet.runner.vision_inputs import VisionShape, pixels, read_shape, template_messages
from fleet.wire.events import (
    ErrorReason,
    OutputEvent,
    TaskFinished,
    TaskStats,
    TokenChunk,
    Usage,
    failed,
)
from fleet.wire.tasks import ChatMessage, TextGeneration

# The most images one task may carry into the engine (the gateway's limit is lower).
MAX_IMAGES = 16


@dataclass
class _Job:
    task: TextGeneration
    prompt_tokens: int
    steps: Iterator[tuple[Any, Any]] | None  # None: a row of the shared batch
    stop_tokens: frozenset[int]
    admitted_at: float
    queue_wait_s: float
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None
    images: int = 0
    cached_images: int = 0  # of them, how many the vision cache saved an encode
    visible: VisibleText | None = None  # the task's stop strings, held back until known
    uid: int | None = None  # its row in the shared batch


class _Masked:
    """mlx-vlm 0.7.6's llama (llava's language model) makes its attention mask with
    `create_attention_mask(h, cache)` over the *list* of layer caches (models/llava/language.py),
    which has no `make_mask`: a BatchKVCache's left padding is never masked, so a shorter
    prompt's row attends to its padding and its greedy tokens differ from its own decode
    (measured: 3 of 4 rows). This passes the first layer cache's mask explicitly."""

    def __init__(self, language_model: Any) -> None:
        self._language_model = language_model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._language_model, name)

    def __call__(self, inputs: Any, cache: Any = None, inputs_embeds: Any = None,
                 **kwargs: Any) -> Any:
        width = (inputs if inputs_embeds is None else inputs_embeds).shape[1]
        if cache and hasattr(cache[0], "make_mask") and kwargs.get("mask") is None:
            kwargs["mask"] = cache[0].make_mask(width, return_array=True)
        kwargs.pop("n_to_process", None)
        return self._language_model(inputs, cache=cache, inputs_embeds=inputs_embeds, **kwargs)


class VisionEngine:
    def __init__(self, config: EngineConfig, on_encode: EncodeHook | None = None) -> None:
        """`on_encode` sees how long each task's images took to become features."""
        self.config = config
        self._on_encode = on_encode
        self._model: Any = None
        self._processor: Any = None
        self._tokenizer: Any = None
        self._batch: Any = None  # mlx-vlm's BatchGenerator, made at the first greedy task
        self._shape: VisionShape | None = None
        self._jobs: list[_Job] = []
        self._ended_at_admission: list[TaskFinished] = []  # continued tasks already done
        self._cancel_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._context_length = config.card.context_length
        self.cache: VisionCache | None = None

    def load(self, progress: Progress) -> None:
        path = Path(self.config.model_path)
        if not (path / "config.json").is_file():
            # mlx-vlm would take a missing directory for a hub id and try to download it.
            raise FileNotFoundError(f"no mlx-vlm model directory at {path}")
        import mlx.core as mx
        from mlx_vlm import load as load_vlm

        progress(0, 1)
        self._model, self._processor = load_vlm(str(path))
        mx.eval(self._model.parameters())
        self._tokenizer = self._processor.tokenizer
        self._shape = read_shape(path)
        self.cache = VisionCache(
            features_dir(self.config.images_dir), self.config.card.id,
            fingerprint(self._model, repr(self._shape)), budget_bytes(),
        )
        progress(1, 1)

    def warm_up(self) -> None:
        """One short decode with an image: the first request pays no first-call costs."""
        import mlx.core as mx
        import numpy as np

        shape = self._vision_shape
        ids = self._encode([{"role": "user", "content": shape.image_token
                             * shape.tokens_per_image + "Hi"}])
        blank = np.zeros((1, 3, shape.image_size, shape.image_size), dtype=np.float32)
        steps = self._generate(ids, mx.array(blank), max_tokens=2, temperature=0.0)
        for _ in steps:
            pass
        self._insert(ids, mx.array(blank), 2, {})  # and the shared batch's prefill and decode
        while self._batch.has_work:
            self._batch.next()

    @property
    def _vision_shape(self) -> VisionShape:
        if self._shape is None:
            raise RuntimeError("the vision engine is not loaded")
        return self._shape

    def admit(self, admission: Admission) -> None:
        task = admission.task
        if not isinstance(task, TextGeneration):
            raise TaskRejected(ErrorReason.UNSUPPORTED,
                               f"model {self.config.card.id} only answers chats")
        hashes = task.image_hashes()
        if len(hashes) > MAX_IMAGES:
            raise TaskRejected(ErrorReason.INVALID_TASK,
                               f"{len(hashes)} images; at most {MAX_IMAGES} a task")
        if missing := [h for h in hashes if h not in admission.inputs]:
            raise TaskRejected(ErrorReason.INPUT_MISSING,
                               f"image {missing[0]} did not reach this node")
        if why := _unsupported(task):
            raise TaskRejected(ErrorReason.UNSUPPORTED,
                               f"{why} is not served on vision models yet")
        messages = task.messages or [ChatMessage(role="user", content=task.prompt or "")]
        ids = self._encode(template_messages(messages, self._vision_shape))
        if len(ids) >= self._context_length:
            raise TaskRejected(ErrorReason.CONTEXT_LENGTH,
                               f"the prompt is {len(ids)} tokens with its images, over the "
                               f"model's maximum of {self._context_length}")
        started = time.time()
        images, features, cached = self._images(hashes, admission.inputs)
        if hashes and self._on_encode is not None:
            self._on_encode(EncodeTiming(task.task_id, started, time.time(), len(hashes), cached))
        # A continued task goes on after the tokens its earlier attempts streamed: they
        # join the prompt, and indexes and usage count on from them.
        generated = list(admission.generated)
        job = _Job(
            task=task, prompt_tokens=len(ids), steps=iter(()), stop_tokens=self._stop_tokens(),
            admitted_at=time.monotonic(), queue_wait_s=admission.queue_wait_s,
            tokens=generated, text=self._tokenizer.decode(generated).rstrip("\ufffd"),
            visible=VisibleText(task.stop, None) if task.stop else None,
            images=len(hashes), cached_images=cached,
        )
        stopped = False
        if job.visible is not None and generated:
            job.visible.push(job.text)  # shown before; only whether it already stopped counts
            stopped = job.visible.stopped
        if generated and (stopped or generated[-1] in job.stop_tokens
                          or len(generated) >= task.max_tokens):
            ended = "stop" if stopped or generated[-1] in job.stop_tokens else "length"
            self._jobs.append(job)
            self._ended_at_admission.append(self._finish(job, ended))
            return
        extra = {} if features is None else {"cached_image_features": features}
        left = task.max_tokens - len(generated)
        if is_greedy(task):
            job.steps = None
            job.uid = self._insert(ids + generated, images, left, extra)
        else:
            job.steps = self._generate(ids + generated, images, left, **_sampling(task), **extra)
        self._jobs.append(job)

    def _insert(self, ids: list[int], images: Any, max_tokens: int,
                extra: dict[str, Any]) -> int:
        """The prompt as a row of the shared batch: its embeddings with the images merged."""
        import mlx.core as mx
        from mlx_vlm.generate.ar import BatchGenerator

        if self._batch is None:
            width = max(1, self.config.slots)
            # prefill_batch_size 1: a newcomer is prefilled while up to `width` rows decode
            # (the generator admits a prefill batch only when that many rows are free).
            self._batch = BatchGenerator(
                _Masked(self._model.language_model), self._processor, stop_tokens=set(),
                sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
                completion_batch_size=width, prefill_batch_size=1, compute_logprobs=False,
            )
        embeds = self._model.get_input_embeddings(mx.array([ids]), images, **extra).inputs_embeds
        [uid] = self._batch.insert([ids], max_tokens=max_tokens,
                                   prompt_kwargs=[{"inputs_embeds": embeds}])
        return int(uid)

    def _images(self, hashes: list[str], inputs: dict[str, Path]) -> tuple[Any, Any, int]:
        """(pixel values, features or None, cache hits) for the task's images in order.
        Without a cache: the pixels alone, the model encodes them. With one: each image's
        features from the cache or encoded here one at a time (and kept); the model is then
        given the features and a placeholder for the pixels it no longer reads."""
        import mlx.core as mx

        if not hashes:
            return None, None, 0
        cache = self.cache
        try:
            if cache is None or not cache.enabled:
                return mx.array(pixels([inputs[h] for h in hashes], self._vision_shape)), None, 0
            found = [cache.get(h) for h in hashes]
            hits = sum(1 for features in found if features is not None)
            for index, sha in enumerate(hashes):
                if found[index] is None:
                    found[index] = self._encode_image(inputs[sha])
                    cache.put(sha, found[index])
        except OSError as exc:  # PIL's UnidentifiedImageError is one
            raise TaskRejected(ErrorReason.INPUT_CORRUPT,
                               f"an image could not be read: {exc}") from None
        placeholder = mx.zeros((len(hashes), 3, 1, 1), dtype=mx.float32)
        return placeholder, mx.concatenate(found, axis=0), hits

    def _encode_image(self, path: Path) -> Any:
        """One image's features: the model's own input-embedding step over a prompt of its
        placeholders alone, which places exactly the projected features there."""
        import mlx.core as mx

        shape = self._vision_shape
        one = mx.array(pixels([path], shape))
        ids = mx.array([[shape.image_token_id] * shape.tokens_per_image])
        features = self._model.get_input_embeddings(ids, one).inputs_embeds
        mx.eval(features)
        return features

    def _encode(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _stop_tokens(self) -> frozenset[int]:
        eos = getattr(self._model.config, "eos_token_id", None)
        ids = eos if isinstance(eos, list) else [eos]
        ids = [*ids, self._tokenizer.eos_token_id]
        return frozenset(int(i) for i in ids if i is not None)

    def _generate(self, ids: list[int], images: Any, max_tokens: int,
                  **sampling: Any) -> Iterator[tuple[Any, Any]]:
        import mlx.core as mx
        from mlx_vlm.generate.ar import generate_step

        input_ids = mx.array([ids])
        return generate_step(
            input_ids, self._model, images, mx.ones_like(input_ids),
            max_tokens=max_tokens, **sampling,
        )

    def cancel(self, task_id: str) -> None:
        with self._cancel_lock:
            self._cancelled.add(task_id)

    @property
    def active(self) -> int:
        return len(self._jobs) + len(self._ended_at_admission)

    def close(self) -> None:
        self._jobs.clear()
        self._ended_at_admission.clear()
        if self._batch is not None:
            self._batch.close()
            self._batch = None

    def step(self) -> list[OutputEvent]:
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, set()
        events: list[OutputEvent] = list(self._ended_at_admission)
        self._ended_at_admission.clear()
        for job in list(self._jobs):
            if job.task.task_id in cancelled:
                self._drop(job)
                events.append(failed(job.task.task_id, time.time(), ErrorReason.CANCELLED,
                                     "cancelled"))
        for job in [job for job in self._jobs if job.steps is not None]:
            try:
                token, _ = next(job.steps)
            except StopIteration:
                events.append(self._finish(job, "length"))
                continue
            events += self._advance(job, int(token))
        if self._batch is not None and any(job.uid is not None for job in self._jobs):
            rows = {job.uid: job for job in self._jobs if job.uid is not None}
            _, responses = self._batch.next()
            for response in responses:
                if (job := rows.get(response.uid)) is None or job not in self._jobs:
                    continue
                events += self._advance(job, int(response.token))
                if job in self._jobs and response.finish_reason is not None:
                    # The generator ended the row (its own stop list): ended here too.
                    events.append(self._finish(job, "stop" if response.finish_reason == "stop"
                                               else "length"))
        return events

    def _drop(self, job: _Job) -> None:
        self._jobs.remove(job)
        if job.uid is not None and self._batch is not None:
            self._batch.remove(job.uid)

    def _advance(self, job: _Job, token: int) -> list[OutputEvent]:
        """`job`'s next token, and its end when that was its last."""
        now = time.time()
        if job.first_token_at is None:
            job.first_token_at = time.monotonic()
        if token in job.stop_tokens:
            held = job.visible.flush() if job.visible else ""
            # Text a stop string's prefix held back is shown after all, on the EOS token.
            return [*self._chunk(job, token, held, now, len(job.tokens)),
                    self._finish(job, "stop")]
        job.tokens.append(token)
        text, ended = self._new_text(job), None
        if job.visible is not None:
            text = job.visible.push(text)
            if job.visible.stopped:
                ended = "stop"
            elif len(job.tokens) >= job.task.max_tokens:
                text += job.visible.flush()
        if ended is None and len(job.tokens) >= job.task.max_tokens:
            ended = "length"
        events = self._chunk(job, token, text, now, len(job.tokens) - 1, always=True)
        if ended is not None:
            events.append(self._finish(job, ended))
        return events

    @staticmethod
    def _chunk(job: _Job, token: int, text: str, now: float, index: int,
               always: bool = False) -> list[OutputEvent]:
        if not (always or text):
            return []
        return [TokenChunk(task_id=job.task.task_id, at=now, index=index, token_id=token,
                           text=text)]

    def _new_text(self, job: _Job) -> str:
        """The text the newest token adds; a character still cut in half waits for its rest."""
        whole = self._tokenizer.decode(job.tokens)
        if whole.endswith("\ufffd"):
            return ""
        added, job.text = whole[len(job.text):], whole
        return added

    def _finish(self, job: _Job, reason: str) -> TaskFinished:
        self._drop(job)
        done = time.monotonic()
        completion = len(job.tokens)
        first = job.first_token_at
        return TaskFinished(
            task_id=job.task.task_id, at=time.time(), status="completed",
            node_id=self.config.node_id, runner_id=self.config.runner_id,
            finish_reason="stop" if reason == "stop" else "length",
            stop_sequence=job.visible.stop_sequence if job.visible is not None else None,
            usage=Usage(prompt_tokens=job.prompt_tokens, completion_tokens=completion,
                        total_tokens=job.prompt_tokens + completion, images=job.images,
                        cached_images=job.cached_images),
            stats=TaskStats(
                queue_wait_s=job.queue_wait_s,
                time_to_first_token_s=None if first is None else first - job.admitted_at,
                tokens_per_s=(completion / (done - first)) if first and done > first else None,
                total_s=done - job.admitted_at,
            ),
        )


def _unsupported(task: TextGeneration) -> str | None:
    """What of the task this engine cannot honour (rather than silently ignore). Pure."""
    if task.response_format is not None and task.response_format.type != "text":
        return "response_format " + task.response_format.type
    if task.logprobs or task.top_logprobs:
        return "logprobs"
    if task.tool_choice != "auto":
        return "tool_choice"
    return None


def is_greedy(task: TextGeneration) -> bool:
    """Whether the task's tokens are the argmax of the model's logits alone, so that it can
    share the batch's one greedy sampler. Pure."""
    penalised = (task.logit_bias or task.presence_penalty or task.frequency_penalty
                 or task.repetition_penalty not in (None, 1.0))
    return task.temperature == 0.0 and not penalised


def _sampling(task: TextGeneration) -> dict[str, Any]:
    """The task's sampling as mlx-vlm's generation step takes it (None: off). Pure."""
    return {
        "temperature": task.temperature, "top_p": task.top_p, "top_k": task.top_k,
        "min_p": task.min_p, "seed": task.seed, "logit_bias": task.logit_bias,
        "repetition_penalty": task.repetition_penalty,
        "presence_penalty": task.presence_penalty or None,
        "frequency_penalty": task.frequency_penalty or None,
    }

"""The text engine: admitted tasks decode together in mlx-lm's BatchGenerator (continuous batching).

`admit` tokenizes the task and inserts it into the batch generator, with a copy of the KV
cache of any prefix an earlier task already processed. Each `step` is one call to the batch
generator: one decode step for the running tasks and a prefill chunk for newly admitted ones,
which join the decoding batch at the following step. A task admitted to an idle engine runs
alone on a plain KV cache (see solo.py) until a second one arrives and it moves into the
batch. Several prompts reaching an idle engine at once are read in two groups (burst_split.py);
the runner waits a moment for a burst's later tasks before the first step (company.py).
Each generated token becomes one Token (a TokenChunk with logprobs); a task ends with exactly
one TaskFinished.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load as load_mlx_lm

from fleet.errors import TaskRejected
from fleet.runner.burst_split import prompts_to_start
from fleet.runner.engine import Admission, EngineConfig, EngineEvent, Progress
from fleet.runner.pipeline import PipelineRank
from fleet.runner.prefill_ramp import RAMP_FIRST_TOKENS, expects_company
from fleet.runner.prefix_cache import PrefixCache
from fleet.runner.solo import SequenceSpec, SoloSequence
from fleet.runner.structured import StructuredOutput
from fleet.runner.text_admission import prepare_task
from fleet.runner.text_task import FinishReason, TextTask
from fleet.wire.events import ErrorReason, TaskFinished
from fleet.wire.tasks import TextGeneration

# Memory is the cache's bound (a budget per runner, card extra `prefix_cache_bytes`); the entry
# count only guards the trie's size. With 8 entries, 16 conversations over 4 system prompts
# evicted each other on one runner (cached fraction 0.64 in `fleet bench --only routing`).
PREFIX_CACHE_ENTRIES = 1024
PREFIX_CACHE_BYTES = 1 << 30
PREFILL_STEP_TOKENS = 2048


class TextEngine:
    # A task reaching this engine idle waits up to a quarter of a typical step (at most 20
    # ms) for more before the first step: a burst's tasks 6-17 ms behind it start with it
    # (fleet.runner.company).
    company_share = 0.25

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._model: Any = None
        self._tokenizer: Any = None
        self._token_text: Callable[[int], str] = str
        self._generator: BatchGenerator | None = None
        self._solo: SoloSequence | None = None
        self._solo_uids = 0
        self._context_length = config.card.context_length
        self._vocab_size = 0
        self._stop_tokens: set[int] = set()
        self._structured: StructuredOutput | None = None
        # By the batch generator's uid, or a negative one of our own while a task runs alone.
        self._tasks: dict[int, TextTask] = {}
        self._uids: dict[str, int] = {}  # task id -> uid
        self._ended_at_admission: list[TaskFinished] = []  # continued tasks already done
        self._prefix_cache = self._new_prefix_cache()
        self._cancel_lock = threading.Lock()
        self._cancel_requests: set[str] = set()
        self._pipeline: tuple[Any, int, int] | None = None  # (ring, start, end) of a shard
        # The most tasks run together since the engine was last idle (prefill_ramp.py).
        self._peak_width = 0
        # The batch generator's uids by where their prompt is (burst_split.py): inserted and
        # not yet started, in the generator's order (among them, a lone task that had already
        # started, first); being read; and a burst's first group still without its first
        # token.
        self._queued: list[int] = []
        self._resumed: set[int] = set()
        # Tasks that arrived while a lone task ran, by a negative uid of our own: they go into
        # the batch generator right after it, so that it stays first in the generator's queue.
        self._behind_solo: list[tuple[int, SequenceSpec]] = []
        self._reading: set[int] = set()
        self._first_group: set[int] = set()
        self._held_back: set[int] = set()  # the rest of that burst, still queued
        self._prefill_limit = min(config.slots, 8)

    def use_ring(self, ring: Any, start_layer: int, end_layer: int) -> None:
        """Load only layers [start, end) and run them as one rank of a pipeline."""
        self._pipeline = (ring, start_layer, end_layer)

    def _new_prefix_cache(self) -> PrefixCache | None:
        entries = int(self.config.extra.get("prefix_cache_entries", PREFIX_CACHE_ENTRIES))
        if entries <= 0:
            return None
        max_bytes = int(self.config.extra.get("prefix_cache_bytes", PREFIX_CACHE_BYTES))
        return PrefixCache(max_entries=entries, max_bytes=max_bytes)

    def load(self, progress: Progress) -> None:
        path = Path(self.config.model_path)
        if not (path / "config.json").is_file():
            # mlx-lm would take a missing directory for a hub id and try to download it.
            raise FileNotFoundError(f"no mlx-lm model directory at {path}")
        # Lazy, then layer by layer: the weights are read as each layer is evaluated.
        model, tokenizer, model_config = load_mlx_lm(str(path), lazy=True, return_config=True)
        if self._pipeline is not None:
            model = PipelineRank(model, *self._pipeline)  # before any weight is read
        layers = list(getattr(model, "layers", []))
        total = max(len(layers), 1)
        progress(0, total)
        for done, layer in enumerate(layers[:-1], start=1):
            mx.eval(layer.parameters())
            progress(done, total)
        mx.eval(model.parameters())
        progress(total, total)

        text_config = model_config.get("text_config", model_config)
        self._context_length = int(
            text_config.get("max_position_embeddings") or self.config.card.context_length
        )
        self._vocab_size = int(text_config.get("vocab_size") or len(tokenizer))
        self._model, self._tokenizer = model, tokenizer
        self._stop_tokens = set(tokenizer.eos_token_ids)
        self._structured = StructuredOutput(tokenizer, self._stop_tokens)
        self._token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token: tokenizer.decode([token])
        )
        self._generator = BatchGenerator(
            model,
            stop_tokens=[[token] for token in sorted(self._stop_tokens)],
            completion_batch_size=self.config.slots,
            prefill_batch_size=self._prefill_limit,
            prefill_step_size=PREFILL_STEP_TOKENS,
        )

    def warm_up(self) -> None:
        """Decode alone, then batched (when there are two slots to batch in), greedy and
        sampled: the first real task pays no first-call costs on whichever path it takes."""
        rounds = ((0.0,), (0.0, 0.8)) if self.config.slots > 1 else ((0.0,), (0.8,))
        for round_tasks in rounds:
            for index, temperature in enumerate(round_tasks):
                warm_task = TextGeneration(
                    task_id=f"warm-up-{index}",
                    model=self.config.card.id,
                    prompt="Hello",
                    max_tokens=4,
                    temperature=temperature,
                    top_p=0.9,
                    top_k=8,
                    min_p=0.01,
                    stop=["\n\n"],
                    logprobs=True,
                    top_logprobs=2,
                    seed=index,  # the ranks of a pipeline must draw the same tokens
                )
                self.admit(Admission(task=warm_task))
            while self._tasks:
                self.step()
        # Warm-up prompts are nobody's prefix, and its batch says nothing about real traffic.
        self._prefix_cache = self._new_prefix_cache()
        self._peak_width = 0

    def admit(self, admission: Admission) -> None:
        task = admission.task
        generator = self._require_loaded()
        if not isinstance(task, TextGeneration):
            raise TaskRejected(ErrorReason.UNSUPPORTED, f"a text model cannot run {task.type}")
        if task.task_id in self._uids:
            raise TaskRejected(ErrorReason.INVALID_TASK, f"task {task.task_id} is already running")
        if len(self._tasks) >= self.config.slots:
            raise TaskRejected(
                ErrorReason.QUEUE_FULL, f"all {self.config.slots} slots of this runner are busy"
            )
        prepared = prepare_task(
            task,
            self._tokenizer,
            context_length=self._context_length,
            vocab_size=self._vocab_size,
            prefix_cache=self._prefix_cache,
            structured=self._structured,
            generated=admission.generated,
        )
        text_task = TextTask(
            task=task,
            detokenizer=self._tokenizer.detokenizer,
            token_text=self._token_text,
            visible=prepared.visible,
            prompt_tokens=prepared.prompt_tokens,
            cached_tokens=prepared.cached_tokens,
            system_end=prepared.system_end,
            queue_wait_s=admission.queue_wait_s,
            node_id=self.config.node_id,
            runner_id=self.config.runner_id,
            generated=admission.generated,
        )
        if ended := self._ended_before(text_task, admission.generated, prepared.spec.max_tokens):
            # Its earlier attempt had finished it but died before the terminal.
            self._ended_at_admission.append(
                text_task.finish_now(time.time(), time.perf_counter(), ended)
            )
            return
        if self._solo is not None and self._solo.untouched:
            # Admitted together before any step: the lone task goes into the batch first, as
            # the first to arrive (a burst's first group is read first, burst_split.py).
            self._move_into_batch(self._solo, [])  # nothing read, so no events
        if self._solo is not None:
            self._solo_uids -= 1
            uid = self._solo_uids
            self._behind_solo.append((uid, prepared.spec))
        elif self._tasks:
            uid = self._insert(generator, prepared.spec)
        else:
            self._solo_uids -= 1  # negative: never one of the batch generator's uids
            uid = self._solo_uids
            # After a batch, more tasks are likely on their way: read the prompt in a ramp
            # so that they join it soon (prefill_ramp.py).
            first = RAMP_FIRST_TOKENS if expects_company(self._peak_width) else None
            self._peak_width = 0  # a new busy spell starts
            self._solo = SoloSequence(
                self._model, uid, prepared.spec, self._stop_tokens, PREFILL_STEP_TOKENS, first
            )
        self._tasks[uid] = text_task
        self._uids[task.task_id] = uid
        batched_with = len(self._tasks) - 1
        for running in self._tasks.values():
            running.batched_with = max(running.batched_with, batched_with)

    def _ended_before(
        self, text_task: TextTask, generated: tuple[int, ...], max_tokens: int
    ) -> FinishReason | None:
        if not generated:
            return None
        if text_task.ended_before or generated[-1] in self._stop_tokens:
            return "stop"
        return "length" if max_tokens <= 0 else None

    def step(self) -> list[EngineEvent]:
        events: list[EngineEvent] = list(self._ended_at_admission)
        self._ended_at_admission.clear()
        if self._cancel_requests:
            self._end_cancelled(events)
        if not self._tasks:
            return events
        self._peak_width = max(self._peak_width, len(self._tasks))
        if self._solo is not None and len(self._tasks) > 1:
            self._move_into_batch(self._solo, events)
        if self._behind_solo:
            self._insert_behind_solo()
        decoder: BatchGenerator | SoloSequence = self._solo or self._require_loaded()
        if self._solo is None:
            self._plan_prefill(self._require_loaded())
        prompt_responses, token_responses = decoder.next()
        if self._solo is None:
            self._track_prompts(prompt_responses, token_responses)
        if self._prefix_cache is not None and prompt_responses:
            self._store_system_prompts(decoder, prompt_responses)
        self._on_tokens(decoder, token_responses, events)
        return events

    def _plan_prefill(self, generator: BatchGenerator) -> None:
        """Bound the prompts the generator starts reading this step (burst_split.py)."""
        start = prompts_to_start(
            queued=len(self._queued), resumed=len(self._resumed), reading=len(self._reading),
            group_waiting=len(self._first_group), held=len(self._held_back),
            limit=self._prefill_limit,
        )
        if not self._reading and not self._held_back and start < len(self._queued):
            self._first_group = set(self._queued[:start])
            self._held_back = set(self._queued[start:])
        # The generator fills its prompt batch up to this size, from its queue in order.
        generator.prefill_batch_size = len(self._reading) + start

    def _track_prompts(self, prompt_responses: list[Any], token_responses: list[Any]) -> None:
        for response in prompt_responses:
            uid = response.uid
            if uid in self._queued:
                self._queued.remove(uid)
                self._resumed.discard(uid)
                self._held_back.discard(uid)
            if response.end_of_prompt:
                self._reading.discard(uid)
            else:
                self._reading.add(uid)
        for response in token_responses:
            self._first_group.discard(response.uid)

    def _on_tokens(
        self,
        decoder: BatchGenerator | SoloSequence,
        token_responses: list[Any],
        events: list[EngineEvent],
    ) -> None:
        at = time.time()
        now = time.perf_counter()
        stopped_by_text: list[int] = []
        for response in token_responses:
            text_task = self._tasks[response.uid]
            if text_task.on_token(response, at, now, events) is None:
                continue
            self._forget(response.uid)
            if response.finish_reason is None:
                stopped_by_text.append(response.uid)
            elif self._prefix_cache is not None:
                self._prefix_cache.store(response.all_tokens, response.prompt_cache, "assistant")
        if stopped_by_text:
            # A stop string is found in the text, which the decoder does not see.
            kept = decoder.remove(stopped_by_text, return_prompt_caches=True)
            if self._prefix_cache is not None:
                for cache, tokens in kept.values():
                    self._prefix_cache.store(tokens, cache, "assistant")

    def _move_into_batch(self, solo: SoloSequence, events: list[EngineEvent]) -> None:
        """Another task arrived: the lone task continues in the batch generator."""
        self._solo = None
        next_token = None
        if solo.decoding:
            # Its next token is already being computed: take it, and feed it in the batch.
            _, (response,) = solo.next(look_ahead=False)
            self._on_tokens(solo, [response], events)
            if solo.uid not in self._tasks:
                return
            next_token = response.token
        uid = self._insert(self._require_loaded(), solo.hand_off(next_token))
        if not solo.untouched:
            self._resumed.add(uid)
        self._tasks[uid] = self._tasks.pop(solo.uid)
        self._uids[self._tasks[uid].task.task_id] = uid

    def _insert_behind_solo(self) -> None:
        generator = self._require_loaded()
        for own_uid, spec in self._behind_solo:
            uid = self._insert(generator, spec)
            self._tasks[uid] = self._tasks.pop(own_uid)
            self._uids[self._tasks[uid].task.task_id] = uid
        self._behind_solo.clear()

    def _insert(self, generator: BatchGenerator, spec: SequenceSpec) -> int:
        (uid,) = generator.insert_segments(
            [spec.segments],
            max_tokens=[spec.max_tokens],
            caches=[spec.cache],
            all_tokens=[spec.cached_tokens],
            samplers=[spec.sampler],
            logits_processors=[spec.processors],
        )
        self._queued.append(uid)
        return uid

    def _forget(self, uid: int) -> None:
        text_task = self._tasks.pop(uid)
        del self._uids[text_task.task.task_id]
        if uid in self._queued:
            self._queued.remove(uid)
        self._behind_solo = [entry for entry in self._behind_solo if entry[0] != uid]
        self._resumed.discard(uid)
        self._reading.discard(uid)
        self._first_group.discard(uid)
        self._held_back.discard(uid)
        if self._solo is not None and self._solo.uid == uid:
            self._solo = None

    def _store_system_prompts(
        self, decoder: BatchGenerator | SoloSequence, prompt_responses: list[Any]
    ) -> None:
        ended = [
            response.uid
            for response in prompt_responses
            if response.end_of_segment
            and not response.end_of_prompt
            and self._tasks[response.uid].system_end
        ]
        if not ended or self._prefix_cache is None:
            return
        for uid, (cache, tokens) in decoder.extract_cache(ended).items():
            self._prefix_cache.store(tokens, cache, "system")
            self._tasks[uid].system_end = 0

    def _end_cancelled(self, events: list[EngineEvent]) -> None:
        with self._cancel_lock:
            requested, self._cancel_requests = self._cancel_requests, set()
        uids = [self._uids[task_id] for task_id in requested if task_id in self._uids]
        if not uids:
            return
        # A lone task needs no removal: forgetting it drops its decoder.
        self._require_loaded().remove(uids)
        at = time.time()
        for uid in uids:
            events.append(self._tasks[uid].cancelled(at, time.perf_counter()))
            self._forget(uid)

    def cancel(self, task_id: str) -> None:
        with self._cancel_lock:
            self._cancel_requests.add(task_id)

    @property
    def active(self) -> int:
        return len(self._tasks) + len(self._ended_at_admission)

    def close(self) -> None:
        if self._generator is not None:
            self._generator.close()
        self._generator = None
        self._solo = None
        self._model = self._tokenizer = None
        self._tasks.clear()
        self._uids.clear()
        self._queued.clear()
        self._resumed.clear()
        self._behind_solo.clear()
        self._reading.clear()
        self._first_group.clear()
        self._held_back.clear()
        self._prefix_cache = None
        mx.clear_cache()

    def _require_loaded(self) -> BatchGenerator:
        if self._generator is None:
            raise RuntimeError("the text engine has no model loaded")
        return self._generator

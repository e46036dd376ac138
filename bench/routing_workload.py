"""The multi-turn workload of `fleet bench --only routing`, and one turn on each path.

C conversations over K long system prompts; each conversation asks `turns` questions, each
prompt being the previous one plus the reply it got and a new user message, with think time
between turns (seeded exponential), so the arrival pattern is the same on every path. Nobody
tunes it to a router: conversations pick their system prompt round robin and start staggered.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from nats.aio.client import Client
from nats.aio.msg import Msg

from fleet.bus.connect import js_publish
from fleet.wire import subjects
from fleet.wire.codec import decode_events
from fleet.wire.events import TaskFinished, TokenChunk
from fleet.wire.tasks import ChatMessage, TextGeneration

_VOCABULARY = (
    "harbour van parcel route street lighthouse market coast wind lane driver depot morning "
    "crate ledger tide crane bridge ferry warehouse invoice schedule signal anchor storm quay"
)
WORDS = _VOCABULARY.split()


@dataclass(frozen=True)
class Workload:
    conversations: int
    system_prompts: int
    turns: int
    max_tokens: int
    think_s: float  # mean think time between a reply and the next question
    system_tokens: int  # each system prompt is cut to about this many tokens
    seed: int = 7


@dataclass
class Turn:
    conversation: int
    turn: int
    start_s: float
    first_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    runner_id: str | None = None
    error: str | None = None
    text: str = field(default="", repr=False)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.start_s


def system_prompts(workload: Workload, count_tokens: Callable[[str], int]) -> list[str]:
    """K distinct system prompts of about `system_tokens` tokens each (seeded words)."""
    rng = random.Random(workload.seed)
    prompts = []
    for k in range(workload.system_prompts):
        text = f"You are desk {k} of the harbour office. "
        while count_tokens(text) < workload.system_tokens:
            sentence = " ".join(rng.choice(WORDS) for _ in range(12))
            text += sentence.capitalize() + ". "
        prompts.append(text)
    return prompts


TurnFn = Callable[[list[dict[str, str]], int, int], Awaitable[Turn]]


def arrivals(workload: Workload) -> list[tuple[float, list[float]]]:
    """Each conversation's start offset and think times (seeded: the same on every path)."""
    rng = random.Random(workload.seed + 1)
    return [
        (rng.uniform(0, workload.think_s * 2),
         [rng.expovariate(1 / workload.think_s) for _ in range(workload.turns)])
        for _ in range(workload.conversations)
    ]


def arrival_floor_s(workload: Workload) -> float:
    """How long the workload lasts even if every answer were instant: the latest
    conversation's start offset plus its think times between turns. No setup's aggregate
    tok/s can exceed its completion tokens over this."""
    return max(offset + sum(thinks[:-1]) for offset, thinks in arrivals(workload))


async def drive(workload: Workload, systems: list[str], send: TurnFn) -> list[Turn]:
    """Every conversation as its own task; returns every turn, in completion order."""
    plans = [(c, systems[c % len(systems)], offset, thinks)
             for c, (offset, thinks) in enumerate(arrivals(workload))]
    done: list[Turn] = []

    async def conversation(c: int, system: str, offset: float, thinks: list[float]) -> None:
        messages = [{"role": "system", "content": system}]
        words = random.Random(workload.seed * 1000 + c)  # the same questions on every path
        await asyncio.sleep(offset)  # the workload's arrival pattern, not synchronisation
        for n, think in enumerate(thinks):
            messages.append({"role": "user", "content": f"Question {n} of visitor {c}: "
                             + " ".join(words.choice(WORDS) for _ in range(20)) + "?"})
            result = await send(list(messages), c, n)
            done.append(result)
            if result.error:
                return
            messages.append({"role": "assistant", "content": result.text})
            await asyncio.sleep(think)  # think time, part of the workload

    await asyncio.gather(*(conversation(*plan) for plan in plans))
    return done


def fleet_sender(nc: Client, model: str, workload: Workload, bias: dict[int, float],
                 t0: float, timeout_s: float = 900.0) -> TurnFn:
    """A turn as a plain `fleet.tasks.<model>` publish (the routing is the worker's)."""
    js = nc.jetstream()

    async def send(messages: list[dict[str, str]], c: int, n: int) -> Turn:
        task_id = f"route-{secrets.token_hex(6)}"
        turn = Turn(c, n, start_s=time.perf_counter() - t0)
        done = asyncio.Event()
        parts: list[str] = []

        async def on_event(msg: Msg) -> None:
            for event in decode_events(msg.data):  # a terminal may carry the last tokens
                if isinstance(event, TokenChunk):
                    turn.first_s = turn.first_s or time.perf_counter() - t0
                    parts.append(event.text)
                elif isinstance(event, TaskFinished):
                    turn.end_s = time.perf_counter() - t0
                    turn.runner_id = event.runner_id
                    if event.usage is not None:
                        turn.tokens = event.usage.completion_tokens
                        turn.prompt_tokens = event.usage.prompt_tokens
                        turn.cached_tokens = event.usage.cached_tokens
                    if event.status != "completed":
                        turn.error = f"{event.status}: {event.message}"
                    done.set()

        sub = await nc.subscribe(subjects.out(task_id), cb=on_event)
        try:
            task = TextGeneration(
                task_id=task_id, model=model, max_tokens=workload.max_tokens, temperature=0.0,
                logit_bias=bias,
                messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages],  # type: ignore[arg-type]
            )
            await js_publish(js, subjects.tasks(model), task, msg_id=task_id)
            await asyncio.wait_for(done.wait(), timeout_s)
        except TimeoutError:
            turn.error = "timed out"
        finally:
            await sub.unsubscribe()
        turn.text = "".join(parts)
        return turn

    return send


def http_sender(client: httpx.AsyncClient, base_url: str, workload: Workload,
                bias: dict[int, float], t0: float) -> TurnFn:
    """A turn as a streamed chat completion (mlx_lm.server, the peer; `model` left out)."""

    async def send(messages: list[dict[str, str]], c: int, n: int) -> Turn:
        turn = Turn(c, n, start_s=time.perf_counter() - t0)
        body: dict[str, Any] = {
            "messages": messages, "max_tokens": workload.max_tokens, "temperature": 0.0,
            "logit_bias": {str(k): v for k, v in bias.items()}, "stream": True,
            "stream_options": {"include_usage": True},
        }
        parts: list[str] = []
        try:
            async with client.stream("POST", f"{base_url}/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    turn.error = f"HTTP {resp.status_code}"
                    return turn
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if usage := chunk.get("usage"):
                        turn.tokens = int(usage.get("completion_tokens") or 0)
                        turn.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        if "cached_tokens" in details:
                            turn.cached_tokens = int(details["cached_tokens"])
                    for choice in chunk.get("choices") or []:
                        if text := (choice.get("delta") or {}).get("content"):
                            turn.first_s = turn.first_s or time.perf_counter() - t0
                            parts.append(text)
        except httpx.HTTPError as exc:
            turn.error = f"{type(exc).__name__}: {exc}"
        turn.end_s = time.perf_counter() - t0
        turn.text = "".join(parts)
        return turn

    return send

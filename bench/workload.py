"""What every path is asked to do, and how one stream's timings become numbers.

A request is chat messages, a token budget and a logit bias that bans every end-of-sequence
token, decoded greedily: each path must produce exactly `max_tokens` tokens, so rates compare
like with like. Two prompt modes give the same prompt length:

- unique: a random nonce opens the system prompt, so no prefix cache can help;
- shared: every request carries the same system prompt and its nonce in the user message,
  so a prefix cache can skip the system prompt's prefill.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PROMPT_MODES = ("unique", "shared")
EOS_BIAS = -100.0  # the bottom of OpenAI's logit_bias range: the token is never chosen

SYSTEM_PROMPT = (
    "You are the dispatcher of a small fleet of delivery vans in a busy harbour city. Each "
    "morning you receive a list of parcels, their weights, the streets they go to and the "
    "hours their owners are at home. You plan routes that keep every van under its load limit, "
    "avoid the market square before noon, prefer the coast road when the wind is calm and "
    "never send two vans down the same narrow lane at once. When a driver calls in sick you "
    "share his parcels among the others. Answer every question in plain words, one short "
    "paragraph, naming the vans by colour: red, blue, green, yellow and white. If a question "
    "has nothing to do with deliveries, answer it anyway, briefly and kindly, then remind the "
    "asker that the vans leave the depot at seven sharp."
)
QUESTION = "Which van should take the heavy parcels to the lighthouse today, and why?"


@dataclass(frozen=True)
class Request:
    messages: list[dict[str, str]]
    max_tokens: int
    logit_bias: dict[int, float]

    def to_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "max_tokens": self.max_tokens,
                "logit_bias": {str(k): v for k, v in self.logit_bias.items()}}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Request:
        return Request(data["messages"], int(data["max_tokens"]),
                       {int(k): float(v) for k, v in data["logit_bias"].items()})


def make_request(mode: str, max_tokens: int, eos_ids: Sequence[int]) -> Request:
    nonce = f"Ticket {secrets.token_hex(4)}."
    if mode == "unique":
        messages = [{"role": "system", "content": f"{nonce} {SYSTEM_PROMPT}"},
                    {"role": "user", "content": QUESTION}]
    elif mode == "shared":
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"{nonce} {QUESTION}"}]
    else:
        raise ValueError(f"unknown prompt mode {mode!r}")
    return Request(messages, max_tokens, {token: EOS_BIAS for token in eos_ids})


@dataclass
class StreamResult:
    """One stream, times in seconds from the start of its burst (the client's clock)."""

    start_s: float
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.start_s

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first over the time they took: the decode rate alone."""
        if self.first_s is None or self.last_s is None or self.tokens < 2:
            return None
        span = self.last_s - self.first_s
        return (self.tokens - 1) / span if span > 0 else None

    @property
    def stream_tok_s(self) -> float | None:
        """All tokens over the whole request, first-token wait included."""
        if self.last_s is None or self.last_s <= self.start_s:
            return None
        return self.tokens / (self.last_s - self.start_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> StreamResult:
        return StreamResult(**data)


def aggregate_tok_s(results: Sequence[StreamResult]) -> float | None:
    """All tokens of a burst over the time from its start to its last token."""
    ends = [r.last_s for r in results if r.last_s is not None]
    if not ends:
        return None
    span = max(ends) - min(r.start_s for r in results)
    return sum(r.tokens for r in results) / span if span > 0 else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    data = sorted(v for v in values if v is not None and not math.isnan(v))
    if not data:
        return None
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def median(values: Sequence[float | None]) -> float | None:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else None


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


def client_queues(requests: Sequence[Request], clients: int) -> list[list[Request]]:
    """Requests dealt round-robin to `clients` closed-loop clients, in order."""
    return [list(requests[k::clients]) for k in range(clients)]


async def closed_loop(
    stream: Callable[[Request, float], Awaitable[StreamResult]], queues: list[list[Request]]
) -> list[StreamResult]:
    """Each queue is one client that sends its next request when the previous one ends (as
    a user or an agent does), all clients at once; times from one start, each stream's TTFT
    from its own send. Results in queue order."""
    t0 = time.perf_counter()

    async def client(requests: list[Request]) -> list[StreamResult]:
        return [await stream(request, t0) for request in requests]

    per_client = await asyncio.gather(*(client(queue) for queue in queues))
    return [result for results in per_client for result in results]

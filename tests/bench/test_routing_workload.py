"""The routing benchmark's workload and summary, driven by a stand-in sender (no model)."""

from __future__ import annotations

import asyncio
from itertools import pairwise

from bench.routing import routing_cost, summarise
from bench.routing_workload import (
    Turn,
    Workload,
    arrival_floor_s,
    arrivals,
    drive,
    system_prompts,
)

WORKLOAD = Workload(conversations=3, system_prompts=2, turns=3, max_tokens=4, think_s=0.001,
                    system_tokens=50)


async def test_each_turn_extends_its_conversation() -> None:
    seen: dict[int, list[list[dict[str, str]]]] = {}

    async def send(messages: list[dict[str, str]], c: int, n: int) -> Turn:
        seen.setdefault(c, []).append(messages)
        return Turn(c, n, start_s=0.0, first_s=0.1, end_s=0.2, tokens=4, prompt_tokens=100,
                    cached_tokens=50 * n, runner_id=f"r{c % 2}", text=f"reply {c}.{n}")

    systems = system_prompts(WORKLOAD, lambda text: len(text.split()))
    assert len(set(systems)) == 2 and all(len(s.split()) >= 50 for s in systems)
    turns = await drive(WORKLOAD, systems, send)
    assert len(turns) == 9
    for c, prompts in seen.items():
        assert prompts[0][0]["content"] == systems[c % 2]
        for earlier, later in pairwise(prompts):
            assert later[:len(earlier)] == earlier  # the previous prompt, unchanged
            assert later[len(earlier)]["role"] == "assistant"
    summary = summarise(turns, wall_s=1.0)
    assert summary["cached_fraction"] == (0 + 50 + 100) * 3 / 900
    assert summary["runners"] == {"r0": 6, "r1": 3} and not summary["errors"]


def test_routing_cost_is_measured_per_task() -> None:
    cost = routing_cost(system_prompts(WORKLOAD, lambda text: len(text.split())), WORKLOAD)
    assert cost["tasks"] == 9 and 0 < cost["p50_ms"] <= cost["p99_ms"]


async def test_no_turn_starts_before_the_arrival_floor_allows() -> None:
    """The floor is the latest conversation's offset plus its think times between turns: with
    instant answers, the last turn of that conversation starts no sooner."""
    workload = Workload(conversations=4, system_prompts=2, turns=3, max_tokens=4, think_s=0.05,
                        system_tokens=10)
    loop_time = asyncio.get_running_loop().time
    began = loop_time()
    starts: list[float] = []

    async def send(messages: list[dict[str, str]], c: int, n: int) -> Turn:
        starts.append(loop_time() - began)
        return Turn(c, n, start_s=0.0, first_s=0.0, end_s=0.0, tokens=1, text="ok")

    await drive(workload, system_prompts(workload, lambda text: len(text.split())), send)
    floor = arrival_floor_s(workload)
    assert max(starts) >= floor - 0.005  # timer granularity
    assert floor > max(offset for offset, _ in arrivals(workload))  # think times count

"""The text bench's closed-loop clients (issue 23's "8 concurrent clients") and its issue-23
rows: requests dealt to clients, each client sending its next request only when its previous
one ended, on the HTTP/NATS paths (`closed_loop`) and in the limit's BatchGenerator; the
targets table's cells against the peer; the `--slots` default."""

from __future__ import annotations

import argparse
import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from bench.cli import text_plan
from bench.limit import _Engine
from bench.report import targets, text_table
from bench.text import _scenarios
from bench.workload import Request, StreamResult, client_queues, closed_loop, make_request


def request(n: int) -> Request:
    return Request([{"role": "user", "content": str(n)}], n, {})


@pytest.mark.parametrize(("requests", "clients", "queues"), [
    (6, 3, [[0, 3], [1, 4], [2, 5]]),
    (5, 2, [[0, 2, 4], [1, 3]]),
    (2, 4, [[0], [1], [], []]),  # more clients than requests: some send nothing
    (8, 8, [[k] for k in range(8)]),
])
def test_requests_are_dealt_round_robin(requests: int, clients: int,
                                        queues: list[list[int]]) -> None:
    dealt = client_queues([request(n) for n in range(requests)], clients)
    assert [[r.max_tokens for r in queue] for queue in dealt] == queues


async def test_each_client_sends_its_next_request_when_the_previous_ended() -> None:
    active: set[int] = set()
    widest = 0
    log: list[tuple[str, int]] = []
    clock = 0.0

    async def stream(req: Request, t0: float) -> StreamResult:
        nonlocal widest, clock
        assert req.max_tokens not in active
        active.add(req.max_tokens)
        widest = max(widest, len(active))
        log.append(("start", req.max_tokens))
        result = StreamResult(start_s=clock)
        for _ in range(3):  # other clients run meanwhile
            await asyncio.sleep(0)
        clock += 1.0
        result.first_s = result.last_s = clock
        result.tokens = req.max_tokens
        active.discard(req.max_tokens)
        log.append(("end", req.max_tokens))
        return result

    queues = client_queues([request(n) for n in range(1, 10)], 3)
    results = await closed_loop(stream, queues)
    assert widest == 3  # every client at once, never more
    for queue in queues:  # a client's next request starts only after its previous one ended
        for earlier, later in itertools.pairwise(queue):
            assert log.index(("end", earlier.max_tokens)) < log.index(("start",
                                                                       later.max_tokens))
    assert [r.tokens for r in results] == [q.max_tokens for queue in queues for q in queue]


def test_the_limit_admits_each_clients_next_request_into_the_running_batch(
    tiny_llm_dir: Path,
) -> None:
    engine = _Engine(str(tiny_llm_dir))
    eos = sorted(engine.tokenizer.eos_token_ids)
    queues = client_queues([make_request("unique", 5, eos) for _ in range(6)], 3)
    results = engine.clients(queues)
    assert [r.tokens for r in results] == [5] * 6
    for first, second in (results[0:2], results[2:4], results[4:6]):  # queue order
        assert first.last_s is not None and second.first_s is not None
        assert second.start_s >= first.last_s  # sent once the first had ended
        assert second.ttft_s is not None and second.ttft_s > 0


def cell(aggregate: float, ttft: float, peer: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"aggregate_tok_s": aggregate, "ttft_p50_s": ttft,
                           "ttft_p95_s": ttft, "decode_tok_s": 10.0, "errors": 0,
                           "short_streams": 0, "prompt_tokens": 100}
    if peer is not None:
        out["vs_peer"] = {"aggregate_tok_s": aggregate / peer["aggregate_tok_s"],
                          "ttft_p50_s": ttft / peer["ttft_p50_s"]}
    return out


def test_the_issue_23_cells_compare_fleet_with_the_peer() -> None:
    peer = cell(100.0, 0.4)
    row = {"peer": peer, "fleet_http": cell(120.0, 0.2, peer),
           "fleet_nats": cell(63.0, 1.24, peer)}
    result = {"text": {"smollm2-135m": {"results": {"unique": {"clients8": row}}}}}
    found = {(r["target"], r["path"]): (round(r["value"], 2), r["met"])
             for r in targets(result)
             if r["target"].startswith("issue 23") and r["value"] is not None}
    assert found[("issue 23: clients8 aggregate / peer >= 1.0 (unique)", "fleet_http")] == (
        1.2, True)
    assert found[("issue 23: clients8 TTFT p50 / peer <= 1.0 (unique)", "fleet_http")] == (
        0.5, True)
    assert found[("issue 23: clients8 aggregate / peer >= 1.0 (unique)", "fleet_nats")] == (
        0.63, False)
    assert found[("issue 23: clients8 TTFT p50 / peer <= 1.0 (unique)", "fleet_nats")] == (
        3.1, False)
    lines = text_table("smollm2-135m", "unique", {"clients8": row})
    assert any(line.startswith("| clients8 aggregate tok/s | 100.0 | 120.0 | 63.0 |")
               for line in lines)


def args(**given: Any) -> argparse.Namespace:
    base = {"quick": False, "reps": None, "max_tokens": None, "no_peer": False,
            "slots": None, "client_requests": None, "bursts": None}
    return argparse.Namespace(**{**base, **given})


@pytest.mark.parametrize(("given", "slots", "names", "clients"), [
    # the product's default width; the old rows, then 8 clients x 4
    ({}, 0, ["c1", "burst4", "burst8", "burst16", "clients8"], [("clients8", 32, 1, 8)]),
    ({"slots": 16}, 16, ["c1", "burst4", "burst8", "burst16", "clients8"],
     [("clients8", 32, 1, 8)]),
    ({"quick": True}, 0, ["c1", "burst4", "clients8"], [("clients8", 16, 1, 8)]),
    ({"client_requests": 1, "bursts": "8"}, 0, ["c1", "burst8", "clients8"],
     [("clients8", 8, 1, 8)]),
])
def test_the_plan_runs_fleet_with_its_default_slots_and_8_clients(
    given: dict[str, Any], slots: int, names: list[str],
    clients: list[tuple[str, int, int, int]],
) -> None:
    plan = text_plan(args(**given))
    assert plan.slots == slots
    assert [s[0] for s in _scenarios(plan)] == names
    assert [s for s in _scenarios(plan) if s[0].startswith("clients")] == clients


@pytest.mark.parametrize(("streams", "stages"), [
    ([], None),
    # The HTTP path says nothing of the runner: no stages.
    ([StreamResult(start_s=0.0, first_s=1.0)], None),
    # publish at 0.5, accepted at 0.6, 0.8 s in the engine, first token at 1.5: 100 ms to reach
    # the runner, 800 in it, 100 to come back.
    ([StreamResult(start_s=0.5, first_s=1.5, extra={"accepted_s": 0.6, "runner_ttft_s": 0.8})],
     {"to_runner": 100.0, "in_runner": 800.0, "to_client": 100.0}),
    ([StreamResult(start_s=0.0, first_s=t, extra={"accepted_s": 0.01, "runner_ttft_s": t - 0.02})
      for t in (1.0, 2.0, 3.0)],
     {"to_runner": 10.0, "in_runner": 1980.0, "to_client": 10.0}),
])
def test_ttft_stages_split_fleets_first_token_at_the_runner(
    streams: list[StreamResult], stages: dict[str, float] | None
) -> None:
    from bench.text import ttft_stages

    result = ttft_stages(streams)
    if stages is None:
        assert result is None
    else:
        assert result == pytest.approx(stages)

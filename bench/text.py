"""Text generation, four paths side by side on one model, repetitions interleaved.

For each repetition, prompt mode and scenario (concurrency 1, then bursts of 4, 8 and 16, then
closed-loop clients) the four paths run one after another, in an order that rotates with the
repetition, each on its own fresh requests: noise from the shared machine spreads over all paths
alike, and no path sees a prompt another path has already put in a cache.

A burst sends N requests at once and waits for all; `clientsN` is N closed-loop clients, each
sending its next request when its previous one ends, `client_requests` each (issue 23's "8
concurrent clients": arrivals while others decode, which a runner must admit mid-batch).
Fleet runs with `slots` per text runner: 0 is the product default (fleet/batch_width.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.fleet_stack import FleetStack, NatsPath, seed_data_dir
from bench.http_path import OpenAIStreamPath
from bench.limit import LimitPath
from bench.peer import PeerServer
from bench.workload import (
    PROMPT_MODES,
    Request,
    StreamResult,
    aggregate_tok_s,
    client_queues,
    make_request,
    median,
    percentile,
    ratio,
)

log = logging.getLogger("bench.text")

PATHS = ("limit", "peer", "fleet_http", "fleet_nats")


class BenchPath(Protocol):
    name: str

    async def burst(self, requests: list[Request]) -> list[StreamResult]: ...

    async def clients(self, queues: list[list[Request]]) -> list[StreamResult]: ...


@dataclass(frozen=True)
class TextPlan:
    reps: int
    c1_requests: int  # sequential single streams per repetition and mode
    bursts: tuple[int, ...]
    max_tokens: int
    slots: int  # Fleet's slots per text runner; 0: the product default
    with_peer: bool = True
    burst_timeout_s: float = 600.0  # a burst still running after this has hung
    clients: tuple[int, ...] = ()  # closed-loop scenarios: this many clients at once
    client_requests: int = 4  # requests each closed-loop client sends, one after another


class Bursts:
    """Runs each burst under a time limit. A path with a burst that ran out of time is not
    asked again (it would only add the limit to every later cell); its later cells read as
    errors, so the report says what broke instead of the run hanging."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.broken: dict[str, str] = {}

    async def run(self, path: BenchPath, requests: list[Request],
                  clients: int = 0) -> list[StreamResult]:
        """A burst, or with `clients` the requests dealt to that many closed-loop clients."""
        if path.name in self.broken:
            return [StreamResult(start_s=0.0, error=self.broken[path.name]) for _ in requests]
        try:
            async with asyncio.timeout(self.timeout_s):
                if clients:
                    return await path.clients(client_queues(requests, clients))
                return await path.burst(requests)
        except TimeoutError:
            log.error("%s: %d requests ran past %.0f s; the path is left out from here",
                      path.name, len(requests), self.timeout_s)
            self.broken[path.name] = f"skipped: an earlier burst ran past {self.timeout_s:.0f} s"
            return [StreamResult(start_s=0.0, error=f"timed out after {self.timeout_s:.0f} s")
                    for _ in requests]


@dataclass
class Samples:
    """Every stream of one (mode, scenario, path), and each burst's aggregate rate."""

    streams: list[StreamResult]
    aggregates: list[float]

    def summary(self, expected_tokens: int) -> dict[str, Any]:
        ok = [s for s in self.streams if s.error is None and s.ttft_s is not None]
        ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
        decode = [s.decode_tok_s for s in ok if s.decode_tok_s is not None]
        return {
            "streams": len(self.streams),
            "errors": len(self.streams) - len(ok),
            "short_streams": sum(1 for s in ok if s.tokens != expected_tokens),
            "prompt_tokens": median([s.prompt_tokens for s in ok if s.prompt_tokens]),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p95_s": percentile(ttfts, 95),
            "decode_tok_s": median(decode),
            "stream_tok_s": median([s.stream_tok_s for s in ok]),
            # Below 1: tokens reached the client in bunches (SSE chunks merged or delayed), so
            # the decode rate of this path measures its delivery, not its decoding.
            "chunks_per_token": median([s.extra.get("chunks", s.tokens) / s.tokens
                                        for s in ok if s.tokens]),
            "aggregate_tok_s": median(self.aggregates),
            "first_error": next((s.error for s in self.streams if s.error), None),
            "ttft_stages_p50_ms": ttft_stages(ok),
            "samples": {  # every stream, for a second look at a noisy cell
                "ttft_s": [round(v, 4) for v in ttfts],
                "decode_tok_s": [round(v, 2) for v in decode],
                "aggregate_tok_s": [round(v, 2) for v in self.aggregates],
            },
        }


def ttft_stages(streams: Sequence[StreamResult]) -> dict[str, float | None] | None:
    """Where the first token's time went, p50 over the streams that say (Fleet over NATS):
    to_runner (publish -> the worker's task_accepted, sent as it hands the task to the
    runner), in_runner (the engine's admission -> its first token: waiting for the step in
    progress, prefill, decode) and to_client (the rest: the pipe, the worker, NATS)."""
    staged = [s for s in streams if s.ttft_s is not None
              and "accepted_s" in s.extra and "runner_ttft_s" in s.extra]
    if not staged:
        return None
    to_runner = [s.extra["accepted_s"] - s.start_s for s in staged]
    in_runner = [s.extra["runner_ttft_s"] for s in staged]
    to_client = [s.ttft_s - a - r for s, a, r in zip(staged, to_runner, in_runner, strict=True)
                 if s.ttft_s is not None]

    def p50_ms(values: list[float]) -> float | None:
        value = percentile(values, 50)
        return None if value is None else round(1000 * value, 1)

    return {"to_runner": p50_ms(to_runner), "in_runner": p50_ms(in_runner),
            "to_client": p50_ms(to_client)}


async def run_model(
    model_id: str, model_dir: Path, plan: TextPlan, workdir: Path, env: dict[str, str],
    custom_card: bool,
) -> dict[str, Any]:
    """Start the limit, the peer and Fleet on one model, measure, stop them."""
    workdir.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"model": model_id, "model_dir": str(model_dir)}
    limit = LimitPath(model_dir, env, workdir / "limit.log")
    peer = PeerServer(model_dir, env, workdir) if plan.with_peer else None
    data_dir = workdir / "fleet-data"
    seed_data_dir(data_dir, {} if custom_card else {model_id: model_dir},
                  {model_id: model_dir} if custom_card else {})
    stack = FleetStack(data_dir, [model_id], plan.slots, env)
    paths: list[BenchPath] = []
    http_clients: list[OpenAIStreamPath] = []
    try:
        # The three start together (model loads overlap); each reports its own startup time.
        began = time.perf_counter()
        ready, _, nc = await asyncio.gather(
            limit.start(), peer.start() if peer is not None else asyncio.sleep(0),
            stack.start(),
        )
        info["limit"] = {"startup_s": ready.get("startup_s"), "blas": ready.get("blas")}
        info["startup_all_s"] = time.perf_counter() - began
        eos_ids: list[int] = ready["eos_ids"]
        paths.append(limit)
        if peer is not None:
            peer_path = OpenAIStreamPath("peer", peer.base_url, None)
            http_clients.append(peer_path)
            paths.append(peer_path)
            info["peer"] = {"startup_s": peer.startup_s, "openblas_mapped": peer.openblas}
        info["fleet"] = {"startup_s": stack.startup_s, "slots": plan.slots,
                         "runner_slots": stack.runner_slots.get(model_id)}
        gateway = OpenAIStreamPath("fleet_http", stack.base_url, model_id)
        http_clients.append(gateway)
        paths += [gateway, NatsPath(nc, model_id)]
        bursts = Bursts(plan.burst_timeout_s)
        await _warm_up(bursts, paths, eos_ids)
        samples = await _measure(bursts, paths, plan, eos_ids)
        info["broken_paths"] = bursts.broken
    finally:
        for client in http_clients:
            await client.close()
        stopping = time.perf_counter()
        await asyncio.gather(
            stack.stop(), limit.stop(),
            asyncio.to_thread(peer.stop) if peer is not None else asyncio.sleep(0),
        )
        log.info("stopped in %.1fs (fleet up graceful: %s, peer graceful: %s)",
                 time.perf_counter() - stopping, stack.stop_s,
                 peer.stop_s if peer is not None else "-")
    info["results"] = _summarise(samples, plan)
    return info


async def _warm_up(bursts: Bursts, paths: Sequence[BenchPath], eos_ids: list[int]) -> None:
    """First calls pay one-off costs (connections, caches of compiled shapes): not measured."""
    for path in paths:
        await bursts.run(path, [make_request("unique", 4, eos_ids)])
        await bursts.run(path, [make_request("unique", 4, eos_ids) for _ in range(2)])


def _scenarios(plan: TextPlan) -> list[tuple[str, int, int, int]]:
    """(name, requests per run, runs per repetition, closed-loop clients or 0 for a burst)."""
    return ([("c1", 1, plan.c1_requests, 0)] + [(f"burst{n}", n, 1, 0) for n in plan.bursts]
            + [(f"clients{n}", n * plan.client_requests, 1, n) for n in plan.clients])


async def _measure(
    bursts: Bursts, paths: Sequence[BenchPath], plan: TextPlan, eos_ids: list[int]
) -> dict[tuple[str, str, str], Samples]:
    samples: dict[tuple[str, str, str], Samples] = {}
    for rep in range(plan.reps):
        order = list(paths[rep % len(paths):]) + list(paths[: rep % len(paths)])
        for mode in PROMPT_MODES:
            for scenario, width, count, clients in _scenarios(plan):
                for _ in range(count):
                    for path in order:
                        requests = [make_request(mode, plan.max_tokens, eos_ids)
                                    for _ in range(width)]
                        results = await bursts.run(path, requests, clients)
                        cell = samples.setdefault((mode, scenario, path.name), Samples([], []))
                        cell.streams += results
                        if (rate := aggregate_tok_s(results)) is not None:
                            cell.aggregates.append(rate)
                log.info("rep %d %s %s done", rep + 1, mode, scenario)
    return samples


def _summarise(
    samples: dict[tuple[str, str, str], Samples], plan: TextPlan
) -> dict[str, dict[str, dict[str, Any]]]:
    """results[mode][scenario][path] = summary, with ratios to the limit and to the peer."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (mode, scenario, path), cell in samples.items():
        out.setdefault(mode, {}).setdefault(scenario, {})[path] = cell.summary(plan.max_tokens)
    for scenarios in out.values():
        for row in scenarios.values():
            for base_name in ("limit", "peer"):
                base = row.get(base_name)
                if base is None:
                    continue
                for cell in row.values():
                    cell[f"vs_{base_name}"] = {
                        key: ratio(cell[key], base[key])
                        for key in ("ttft_p50_s", "ttft_p95_s", "decode_tok_s", "aggregate_tok_s")
                    }
                    if cell["ttft_p50_s"] is not None and base["ttft_p50_s"] is not None:
                        cell[f"ttft_added_ms_vs_{base_name}"] = 1000 * (
                            cell["ttft_p50_s"] - base["ttft_p50_s"]
                        )
    return out

"""`fleet bench --only routing`: one multi-turn workload on four setups of one model.

(a) `one_runner`: Fleet with one runner; (b) `shared_queue`: two runners, today's dispatch
(the runner with most free slots; FLEET_PREFIX_ROUTING=0); (c) `prefix_routing`: two runners,
prefix-aware dispatch; (d) `peer`: mlx_lm.server, one process with its own prompt cache.
Each setup starts fresh (empty caches), is warmed up with two short unrelated requests, then
runs the same seeded workload (bench/routing_workload.py). The routing cost is measured in
process on the same prompts: block hashing plus the choice, the code the worker runs.

The machine is shared, so wall-clock figures carry the neighbours' load: every setup records
the load average before and after, and the CPU seconds its model processes (the runners, or
the peer) and its whole process tree spent on the workload, which the neighbours do not
change much: CPU ms per completion token and per turn compare the setups' work, and the
prefilled (uncached) prompt tokens say where the work went.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from nats.aio.client import Client

from bench.fleet_stack import FleetStack, seed_data_dir
from bench.machine import load_average
from bench.peer import PeerServer
from bench.routing_workload import (
    Turn,
    Workload,
    arrival_floor_s,
    drive,
    fleet_sender,
    http_sender,
    system_prompts,
)
from bench.workload import EOS_BIAS, percentile
from fleet.models.catalog import get_card
from fleet.placement import read_nodes
from fleet.placement_replicas import place_replicas
from fleet.wire import subjects
from fleet.wire.cluster import RunnerRecord
from fleet.wire.codec import decode_model
from fleet.wire.tasks import ChatMessage, TextGeneration
from fleet.worker.prefix_blocks import prompt_blocks
from fleet.worker.routing import Candidate, PrefixHeld, choose_runner

log = logging.getLogger("bench.routing")

SCENARIOS = ("one_runner", "shared_queue", "prefix_routing", "peer")
READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RoutingPlan:
    workload: Workload
    slots: int  # per runner
    scenarios: tuple[str, ...] = SCENARIOS


def full_plan() -> RoutingPlan:
    return RoutingPlan(Workload(conversations=16, system_prompts=4, turns=3, max_tokens=32,
                                think_s=2.0, system_tokens=800), slots=4)


def quick_plan() -> RoutingPlan:
    return RoutingPlan(Workload(conversations=4, system_prompts=2, turns=2, max_tokens=8,
                                think_s=0.2, system_tokens=300), slots=2,
                       scenarios=("prefix_routing",))  # one stack start: CI time


async def run_routing(model_id: str, model_dir: Path, custom_card: bool, plan: RoutingPlan,
                      workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    systems = system_prompts(plan.workload, lambda text: len(tokenizer.encode(text)))
    bias = {int(t): EOS_BIAS for t in tokenizer.eos_token_ids}
    info: dict[str, Any] = {"model": model_id, "plan": asdict(plan), "scenarios": {},
                            "system_prompt_tokens": [len(tokenizer.encode(s)) for s in systems]}
    for scenario in plan.scenarios:
        log.info("routing: %s %s", model_id, scenario)
        where = workdir / scenario
        where.mkdir(parents=True, exist_ok=True)
        load_before = load_average()
        if scenario == "peer":
            turns, wall, cpu = await _peer(model_dir, env, where, plan, systems, bias)
        else:
            turns, wall, cpu = await _fleet(model_id, model_dir, custom_card, scenario, plan,
                                            where, env, systems, bias)
        info["scenarios"][scenario] = {
            **summarise(turns, wall, cpu), "load_before": load_before, "load_after": load_average(),
        }
    info["arrival_floor_s"] = arrival_floor_s(plan.workload)
    info["routing_cost"] = routing_cost(systems, plan.workload)
    try:  # an aside to the workload's figures: its failure must not lose them
        info["hand_off_cost"] = await hand_off_cost(workdir / "hand-off", systems[0])
    except Exception as exc:
        log.exception("routing: the hand-off cost was not measured")
        info["hand_off_cost"] = {"error": f"{type(exc).__name__}: {exc}"}
    return info


async def hand_off_cost(where: Path, system: str, requests: int = 500) -> dict[str, Any]:
    """What routing across nodes adds per task handed over: the TaskHandOff request and its
    answer, between two connections of a real nats-server on loopback (decode and encode
    on both sides, as the workers do)."""
    import nats as nats_client

    from fleet.bus.embedded import EmbeddedNats
    from fleet.wire.codec import encode
    from fleet.wire.handoff import HandOffAnswer, TaskHandOff

    server = EmbeddedNats(where / "nats", port=0).start()
    try:
        sender, receiver = (await nats_client.connect(server.url),
                            await nats_client.connect(server.url))

        async def answer(msg: Any) -> None:
            decode_model(TaskHandOff, msg.data)
            await receiver.publish(msg.reply, encode(HandOffAnswer(taken=True)))

        await receiver.subscribe(subjects.handoff("node-b"), cb=answer)
        await receiver.flush()
        task = TextGeneration(task_id="cost", model="m", messages=[
            ChatMessage(role="system", content=system), ChatMessage(role="user", content="q")])
        offer = encode(TaskHandOff(
            from_node="node-a", runner_id="run-b", subject=subjects.tasks("m"),
            ack_subject="$JS.ACK.FLEET_TASKS.tasks-m.1.42.42.1764000000000000000.0",
            data=encode(task).decode(),
        ))
        await _until_answered(sender, subjects.handoff("node-b"), offer)
        times: list[float] = []
        for _ in range(requests):
            began = time.perf_counter()
            reply = await sender.request(subjects.handoff("node-b"), offer, timeout=5)
            decode_model(HandOffAnswer, reply.data)
            times.append(time.perf_counter() - began)
        await sender.close()
        await receiver.close()
    finally:
        server.stop()
    return {"requests": requests, "bytes": len(offer),
            "p50_ms": (percentile(times, 50) or 0) * 1000,
            "p99_ms": (percentile(times, 99) or 0) * 1000}


async def _until_answered(nc: Any, subject: str, data: bytes, within_s: float = 10.0) -> None:
    """Wait until `subject` has a responder: at the end of a long run the receiver's
    subscription was once not yet known to the server after its flush (no responders)."""
    import nats.errors

    deadline = time.monotonic() + within_s
    while True:
        try:
            await nc.request(subject, data, timeout=1)
            return
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)  # polling the server's interest, bounded by `within_s`


async def _fleet(model_id: str, model_dir: Path, custom_card: bool, scenario: str,
                 plan: RoutingPlan, where: Path, env: dict[str, str], systems: list[str],
                 bias: dict[int, float]) -> tuple[list[Turn], float, dict[str, float]]:
    data_dir = where / "fleet-data"
    seed_data_dir(data_dir, {} if custom_card else {model_id: model_dir},
                  {model_id: model_dir} if custom_card else {})
    routing = "1" if scenario == "prefix_routing" else "0"
    stack = FleetStack(data_dir, [model_id], plan.slots, {**env, "FLEET_PREFIX_ROUTING": routing})
    try:
        nc = await stack.start()
        if scenario != "one_runner":
            await _second_runner(nc, model_id, data_dir, plan.slots)
        await _warm_up(fleet_sender(nc, model_id, plan.workload, bias, time.perf_counter()))
        assert stack.process is not None
        before = cpu_seconds(stack.process.pid)
        t0 = time.perf_counter()
        turns = await drive(plan.workload, systems,
                            fleet_sender(nc, model_id, plan.workload, bias, t0))
        wall = time.perf_counter() - t0
        return turns, wall, _spent(before, cpu_seconds(stack.process.pid))
    finally:
        await stack.stop()


async def _second_runner(nc: Client, model_id: str, data_dir: Path, slots: int) -> None:
    """Place a second replica beside `fleet up`'s and wait until both are ready."""
    js = nc.jetstream()
    kv = await js.key_value(subjects.RUNNERS_BUCKET)
    watcher = await kv.watchall()
    nodes = await read_nodes(js)
    await place_replicas(js, get_card(model_id, data_dir), 1, node_id=nodes[0].node_id,
                         slots=slots)
    ready: set[str] = set()
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            while len(ready) < 2:
                try:
                    entry = await watcher.updates(timeout=1.0)
                except TimeoutError:
                    continue
                if entry is not None and entry.value:
                    record = decode_model(RunnerRecord, entry.value)
                    if record.model == model_id and record.status.state == "ready":
                        ready.add(record.runner_id)
    finally:
        await watcher.stop()


async def _peer(model_dir: Path, env: dict[str, str], where: Path, plan: RoutingPlan,
                systems: list[str], bias: dict[int, float],
                ) -> tuple[list[Turn], float, dict[str, float]]:
    peer = PeerServer(model_dir, env, where)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        try:
            await peer.start()
            await _warm_up(http_sender(client, peer.base_url, plan.workload, bias,
                                       time.perf_counter()))
            assert peer.process is not None
            before = cpu_seconds(peer.process.pid, model_marker="")
            t0 = time.perf_counter()
            turns = await drive(plan.workload, systems,
                                http_sender(client, peer.base_url, plan.workload, bias, t0))
            wall = time.perf_counter() - t0
            return turns, wall, _spent(before, cpu_seconds(peer.process.pid, model_marker=""))
        finally:
            await asyncio.to_thread(peer.stop)


async def _warm_up(send: Any) -> None:
    await asyncio.gather(*(send([{"role": "user", "content": f"warm up {i}"}], -1, i)
                           for i in range(2)))


def cpu_seconds(root_pid: int, model_marker: str = "fleet.runner.main") -> dict[str, float]:
    """User + system CPU seconds so far of a process tree (`all`) and of its processes whose
    command line holds `model_marker` (`model`: the runners; "" for the peer: all of it)."""
    spent = {"all": 0.0, "model": 0.0}
    root = psutil.Process(root_pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            is_model = model_marker in " ".join(process.cmdline())
        except psutil.Error:
            continue
        spent["all"] += times.user + times.system
        if is_model:
            spent["model"] += times.user + times.system
    return spent


def _spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def summarise(turns: list[Turn], wall_s: float,
              cpu: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    reported = [t for t in ok if t.cached_tokens is not None]
    prompt = sum(t.prompt_tokens for t in reported)
    ends = [t.end_s for t in ok if t.end_s is not None]
    span = (max(ends) - min(t.start_s for t in ok)) if ends else None
    tokens = sum(t.tokens for t in ok)
    cpu = cpu or {}
    return {
        "turns": len(turns), "errors": [t.error for t in turns if t.error][:5],
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "cached_fraction": (sum(t.cached_tokens or 0 for t in reported) / prompt
                            if prompt else None),
        "prompt_tokens_mean": (sum(t.prompt_tokens for t in ok) / len(ok)) if ok else None,
        "aggregate_tok_s": tokens / span if span else None,
        "span_s": span, "completion_tokens": tokens,
        "wall_s": wall_s,
        "runners": dict(Counter(t.runner_id for t in ok if t.runner_id)),
        "prefilled_tokens": (sum(t.prompt_tokens - (t.cached_tokens or 0) for t in reported)
                             if reported else None),
        "model_cpu_s": cpu.get("model"), "all_cpu_s": cpu.get("all"),
        "model_cpu_ms_per_token": (cpu["model"] * 1000 / tokens
                                   if cpu.get("model") and tokens else None),
        "per_turn": [  # for the analysis: which turns missed the cache, and where they ran
            {"conversation": t.conversation, "turn": t.turn, "start_s": round(t.start_s, 3),
             "ttft_s": None if t.ttft_s is None else round(t.ttft_s, 3),
             "prompt": t.prompt_tokens, "cached": t.cached_tokens, "runner": t.runner_id}
            for t in turns
        ],
    }


def routing_cost(systems: list[str], workload: Workload, runners: int = 2) -> dict[str, Any]:
    """Per task: hashing its prompt into blocks, choosing among `runners` whose indexes hold
    every earlier prompt of the workload's shape, and recording the blocks on the chosen one:
    what the worker does per dispatch."""
    held = [PrefixHeld() for _ in range(runners)]
    times: list[float] = []
    for n in range(workload.conversations * workload.turns):
        messages = [ChatMessage(role="system", content=systems[n % len(systems)])]
        for turn in range(n % workload.turns + 1):
            messages += [ChatMessage(role="user", content=f"question {turn} of {n} " * 8),
                         ChatMessage(role="assistant", content="an answer " * 10)]
        task = TextGeneration(task_id=f"cost-{n}", model="m", messages=messages)
        began = time.perf_counter()
        blocks = prompt_blocks(task)
        candidates = [Candidate(f"r{i}", 4, i, held[i]) for i in range(runners)]
        chosen = choose_runner(blocks, candidates)
        index = int(chosen[1:]) if chosen else 0
        held[index] = held[index].served(blocks, 4096)  # the dispatch's state update
        times.append(time.perf_counter() - began)
    return {"tasks": len(times), "p50_ms": (percentile(times, 50) or 0) * 1000,
            "p99_ms": (percentile(times, 99) or 0) * 1000}

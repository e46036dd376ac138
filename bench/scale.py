"""`fleet bench --only scale`: what one real worker, the gateways and nats-server pay as the
fleet grows from N = 10 nodes to 1,000, idle and under a fixed per-node load.

The N nodes are simulated (bench.scale_sim: Fleet's node-agent code, many per process, each
with a connection of its own); one real `fleet worker` (serving the fault engine's `sim-m0`,
one of the ten models the fleet serves) and G real `fleet gateway`s run beside them and are
measured from outside: CPU seconds and RSS from the OS, messages and bytes received from
nats-server's `/connz`. Per step: an idle window, then a window with 2 streams of 20 tok/s on
each busy node (a tenth of the nodes, at most 50), then a node SIGKILL-like loss (its
connection closed, no goodbye) timed until its instance is placed elsewhere, and a placement
decision timed over the live heartbeats.

`--scale-src DIR` runs the real worker and gateways from another checkout too (the design
before this one, `git worktree add DIR <commit>`), its simulated nodes composed as that design
did (`--design baseline` of bench.scale_sim), and prints both tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.procs import free_port
from bench.scale_connz import Received, read_connz, received_by
from bench.scale_sim import KILL, LOAD, READY, sim_model, sim_node_id
from fleet.bus.connect import connect
from fleet.bus.embedded import ops_dir, server_binary
from fleet.bus.kv_calls import kv_get
from fleet.bus.kv_read import live_values
from fleet.bus.provision import provision
from fleet.models.catalog import custom_cards_dir
from fleet.placement import choose_node, new_instance
from fleet.runner.fault_engine import fault_card
from fleet.wire import subjects
from fleet.wire.cluster import Instance, NodeInfo, ShardAssignment
from fleet.wire.codec import decode_model, encode

log = logging.getLogger("bench.scale")

REPO = Path(__file__).resolve().parent.parent
NODES_PER_PROCESS = 250
MODELS = 10
BUSY_FRACTION = 0.1
MAX_BUSY = 50
CATALOGUE_POLL_S = 0.05
# The baseline's simulated nodes each watch every heartbeat and advert: N²/3 messages a second
# among themselves, past what this 2-core machine carries beyond a few hundred nodes.
BASELINE_MAX_N = 300


@dataclass(frozen=True)
class ScalePlan:
    steps: tuple[int, ...] = (10, 100, 1000)
    gateways: int = 1
    window_s: float = 20.0
    settle_s: float = 10.0
    failover: bool = True
    servers: int = 1  # 3: the cluster from ops/nats


QUICK = ScalePlan(steps=(10, 40), gateways=1, window_s=6.0, settle_s=4.0, failover=False)


@dataclass
class Stack:
    src: Path
    design: str
    work: Path
    servers: int = 1  # 3: the cluster of ops/nats/cluster-{1,2,3}.conf, on free ports
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    sims: list[subprocess.Popen[bytes]] = field(default_factory=list)
    gateway_ports: list[int] = field(default_factory=list)
    worker_node: str = ""

    def __post_init__(self) -> None:
        self.nats_ports = [free_port() for _ in range(self.servers)]
        self.monitor_ports = [free_port() for _ in range(self.servers)]
        self.route_ports = [free_port() for _ in range(self.servers)]

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{port}" for port in self.nats_ports)

    @property
    def monitors(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.monitor_ports]

    @property
    def server_names(self) -> list[str]:
        """The servers' process names: "nats" (the first: its row sums them all), "nats-2".."""
        return ["nats", *(f"nats-{i}" for i in range(2, self.servers + 1))]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(self.src), "FLEET_NATS_URL": self.url,
                "MLX_DISABLE_COMPILE": "1", "OPENBLAS_NUM_THREADS": "1"}

    def spawn(self, name: str, args: list[str], cwd: Path | None = None) -> None:
        with (self.work / f"{name}.log").open("ab") as out:
            self.procs[name] = subprocess.Popen(
                args, cwd=cwd or self.src, env=self.env(), stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        for process in [*self.sims, *reversed(self.procs.values())]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)


async def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if found := await check():
                return found
        await asyncio.sleep(0.2)  # polling processes that start, bounded by the deadline
    raise TimeoutError(f"scale: {what} not ready in {timeout:.0f} s")


async def start_server(stack: Stack) -> Client:
    for index, name in enumerate(stack.server_names):
        store = stack.work / f"store-{index + 1}"
        store.mkdir(parents=True, exist_ok=True)
        # The shipped config, with room for every stream's reservation (N nodes' connections
        # and the bench's own streams are what is measured, not the store).
        config = stack.work / f"{name}.conf"
        config.write_text(_server_config(stack, index).replace(
            "max_file_store: 16GB", "max_file_store: 1TB").replace(
            f'"./.fleet/cluster/n{index + 1}"', f'"{store}"'))  # a cluster file names its own
        stack.spawn(name, [str(server_binary()), "-c", str(config), "-a", "127.0.0.1",
                           "-p", str(stack.nats_ports[index]), "-m",
                           str(stack.monitor_ports[index]), "-js",
                           *(["-sd", str(store)] if stack.servers == 1 else [])])

    async def varz() -> bool:
        async with httpx.AsyncClient() as client:
            return all([(await client.get(f"{m}/varz")).is_success for m in stack.monitors])

    await _wait(varz, 30, "nats-server")
    nc = await connect(stack.url, "scale-harness", inbox_owner="operator")
    await provision(nc, stack.src / "ops" / "jetstream")  # as the measured processes will
    return nc


def _server_config(stack: Stack, index: int) -> str:
    """single.conf, or cluster-<i>.conf with this stack's ports in place of 4221-4223 (client),
    6221-6223 (routes) and 8221-8223 (monitoring)."""
    if stack.servers == 1:
        return (ops_dir() / "nats" / "single.conf").read_text()
    text = (ops_dir() / "nats" / f"cluster-{index + 1}.conf").read_text()
    for i in range(3):
        text = (text.replace(f"{4221 + i}", str(stack.nats_ports[i]))
                .replace(f"{6221 + i}", str(stack.route_ports[i]))
                .replace(f"{8221 + i}", str(stack.monitor_ports[i])))
    return text


async def start_real(stack: Stack, nc: Client, gateways: int) -> None:
    """The measured processes, after the first simulated nodes: one of those holds the
    sweeper lease, so the real worker is measured as any node but that one is."""
    data = stack.work / "worker"
    folder = custom_cards_dir(data)
    folder.mkdir(parents=True, exist_ok=True)
    card = fault_card(sim_model(0, MODELS)).model_copy(update={"source": str(data)})
    (folder / f"{card.id}.json").write_bytes(encode(card))
    fleet = [sys.executable, "-m", "fleet.cli", "--log-level", "warning"]
    stack.spawn("worker", [*fleet, "--data-dir", str(data), "worker", "--no-auto-place",
                           "--slots", "4"])
    for index in range(gateways):
        port = free_port()
        stack.gateway_ports.append(port)
        # Its card too, so the gateway's /v1/models/sim-m0 answers (time_catalogue).
        cards = custom_cards_dir(stack.work / f"gw{index}")
        cards.mkdir(parents=True, exist_ok=True)
        (cards / f"{card.id}.json").write_bytes(encode(card))
        stack.spawn(f"gateway-{index}", [*fleet, "--data-dir", str(stack.work / f"gw{index}"),
                                         "gateway", "--port", str(port)])

    async def worker_node() -> NodeInfo | None:
        nodes = await live_values(nc.jetstream(), subjects.NODES_BUCKET, NodeInfo)
        return next((n for n in nodes if not n.node_id.startswith("sim-")), None)

    node = await _wait(worker_node, 120, "the real worker")
    stack.worker_node = node.node_id
    instances = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)
    placed = new_instance(card, node, 4, time.time(), f"{card.id}-real")
    await instances.put(placed.instance_id, encode(placed))


async def sweeper_holder(nc: Client) -> str | None:
    from fleet.worker.sweeper import LEASES_BUCKET, SWEEPER

    with contextlib.suppress(Exception):
        entry = await (await nc.jetstream().key_value(LEASES_BUCKET)).get(SWEEPER)
        return (entry.value or b"").decode() or None
    return None


async def add_sims(stack: Stack, nc: Client, upto: int) -> None:
    """Simulated nodes up to `upto`, each writing an instance of its model on itself once it
    beats (`--place-own`). The harness used to place them before the nodes started and beat
    for the nodes meanwhile (a stand-in): at N = 1,000 on a loaded machine its rounds of 900
    puts outlasted the heartbeat TTL, and live nodes' instances were moved as if dead
    (144 in the quiet run of 2026-12-05 00:27, some onto the real worker)."""
    have = sum(int(str(p.args[p.args.index("--count") + 1]))  # type: ignore[index, union-attr]
               for p in stack.sims)
    ready: asyncio.Queue[str] = asyncio.Queue()

    async def on_ready(msg: Msg) -> None:
        ready.put_nowait(msg.data.decode())

    sub = await nc.subscribe(READY, cb=on_ready)
    try:
        if have == 0 and stack.design != "baseline":
            # The first node alone in a process of its own, started before the others: it
            # takes the sweeper lease, so the sweeper is measured as one machine of the
            # fleet would run it, not starved by the other nodes simulated beside it (at
            # N = 1,000 a sweeper among 249 nodes at load 21 moved nothing within 60 s).
            stack.sims.append(_sim(stack, 0, 1))
            stack.procs["sweeper"] = stack.sims[-1]  # measured: CPU and RSS
            await asyncio.wait_for(ready.get(), 120)
            await _wait(lambda: _holds_sweeper(nc, sim_node_id(0)), 30, "the sweeper lease")
            have = 1
        for first in range(have, upto, NODES_PER_PROCESS):
            # One process at a time: four starting together (1,000 connections, each node
            # reading the instance table) starved the running nodes' beats at load 14, and
            # 24 live nodes' instances were moved (3 onto the real worker).
            stack.sims.append(_sim(stack, first, min(NODES_PER_PROCESS, upto - first)))
            await asyncio.wait_for(ready.get(), 120 + NODES_PER_PROCESS / 2)
    finally:
        await sub.unsubscribe()


def _sim(stack: Stack, first: int, count: int) -> subprocess.Popen[bytes]:
    # The sweeper's process logs its decisions (lease, departures seen, moves): a failover
    # that times out prints them (`sweeper_log`).
    logs = {"SIM_LOG": "INFO"} if (first, count) == (0, 1) else {}
    with (stack.work / f"sim-{first}.log").open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "bench.scale_sim", "--url", stack.url, "--first",
             str(first), "--count", str(count), "--models", str(MODELS), "--design",
             stack.design, "--place-own"], cwd=REPO,
            env={**stack.env(), "PYTHONPATH": str(REPO), **logs}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)


def sweeper_log(stack: Stack, lines: int = 30) -> str:
    path = stack.work / "sim-0.log"
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""


async def _holds_sweeper(nc: Client, node: str) -> bool:
    return await sweeper_holder(nc) == node


def _ps(process: subprocess.Popen[bytes]) -> psutil.Process:
    return psutil.Process(process.pid)


def _cpu(process: subprocess.Popen[bytes]) -> float:
    times = _ps(process).cpu_times()
    return times.user + times.system


async def measure(stack: Stack, window_s: float) -> dict[str, Any]:
    """CPU (share of one core), RSS, and msgs/bytes a second received over one window."""
    servers = stack.server_names
    names = [n for n in stack.procs if n not in servers] + ["nats"]
    gateways = sum(1 for n in names if n.startswith("gateway"))
    cpu0 = {n: _cpu(stack.procs[n]) for n in [*names, *servers[1:]]}
    connz0 = await _connz(stack)
    began = time.monotonic()
    await asyncio.sleep(window_s)  # the measurement window
    took = time.monotonic() - began
    connz1 = await _connz(stack)
    out: dict[str, Any] = {}
    for name in names:
        # The nats row: every server of the cluster together (CPU summed; RSS the first's).
        spent = sum(_cpu(stack.procs[n]) - cpu0[n] for n in (servers if name == "nats"
                                                              else [name]))
        row: dict[str, Any] = {
            "cpu": round(spent / took, 4),
            "rss_mb": round(_ps(stack.procs[name]).memory_info().rss / 2**20, 1),
        }
        if name == "worker" or name.startswith("gateway"):
            # Every gateway's connection has the same name: a gateway's share is the mean.
            # A worker's every connection: its console's runner news had one of its own
            # ("fleet-up-runners", a watch of every runner record until 4a152cd).
            conns, share = ((("fleet-worker", "fleet-up-runners"), 1) if name == "worker"
                            else (("fleet-gateway",), gateways))
            got = Received()
            for conn in conns:
                got += received_by(connz1, conn) - received_by(connz0, conn)
            got = Received(got.msgs // share, got.bytes // share)
            row["msgs_s"] = round(got.msgs / took, 1)
            row["kb_s"] = round(got.bytes / took / 1024, 2)
        out[name] = row
    out["loadavg"] = round(os.getloadavg()[0], 1)  # the machine's, shared: read with the numbers
    return out


async def _still(nc: Client, bucket: str, still_s: float, timeout: float = 180.0) -> None:
    """Until `bucket` has taken no write for `still_s` (its stream's last sequence), or
    `timeout` (logged)."""
    js = nc.jetstream()
    began = time.monotonic()
    last, since = -1, time.monotonic()
    while time.monotonic() - began < timeout:
        seq = (await js.stream_info(f"KV_{bucket}")).state.last_seq
        if seq != last:
            last, since = seq, time.monotonic()
        elif time.monotonic() - since >= still_s:
            return
        await asyncio.sleep(0.5)  # polling the stream's state: the resolution of "still"
    log.warning("scale: %s still changing after %.0f s; measured anyway", bucket, timeout)


async def instances_on(nc: Client, node: str) -> int:
    """How many instances have a shard on `node` (the real worker: 1 unless the sweeper moved
    a live simulated node's instance onto it, which adds a runner to what it is measured at)."""
    placed = await live_values(nc.jetstream(), subjects.INSTANCES_BUCKET, Instance)
    return sum(any(s.node_id == node for s in i.shards) for i in placed)


async def moved_while_alive(nc: Client, n: int, killed: set[str]) -> list[str]:
    """The simulated nodes (of the first `n`, none killed) whose instance is no longer on
    them: moved by the sweeper while the node lived, its heartbeat late past the key's TTL
    (a starved simulator process, or a slow server)."""
    placed = {i.instance_id: i for i in await live_values(
        nc.jetstream(), subjects.INSTANCES_BUCKET, Instance)}
    moved = []
    for index in range(n):
        node = sim_node_id(index)
        instance = placed.get(f"{node}-i")
        if node not in killed and instance and all(s.node_id != node for s in instance.shards):
            moved.append(node)
    return moved


async def _connz(stack: Stack) -> dict[str, Any]:
    """Every server's client connections as one list (a client is on one of them)."""
    return {"connections": [conn for monitor in stack.monitors
                            for conn in (await read_connz(monitor)).get("connections") or []]}


async def time_failover(nc: Client, index: int, timeout: float = 60.0) -> float | None:
    """Seconds from a node's loss to its instance placed elsewhere; None past `timeout`."""
    node = sim_node_id(index)
    kv = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)
    entry = await kv.get(f"{node}-i")
    if entry.value and all(s.node_id != node for s in decode_model(Instance, entry.value).shards):
        log.warning("scale: %s's instance was moved before the kill: not timed", node)
        return None
    began = time.monotonic()
    # A request, answered by the node's process once the node is gone: a kill that never
    # arrived (a loaded simulator's control connection dropped it) is told from a slow
    # failover, and sent again.
    for _ in range(3):
        try:
            await nc.request(KILL, node.encode(), timeout=10.0)
            break
        except Exception as exc:
            log.warning("scale: the kill of %s not confirmed (%s); again", node, exc)
    else:
        log.warning("scale: the kill of %s never confirmed", node)
        return None
    nodes = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    key_gone: float | None = None
    while time.monotonic() - began < timeout:
        if key_gone is None and await kv_get(nodes, node) is None:
            key_gone = time.monotonic() - began
            log.info("scale: %s's heartbeat key gone %.1f s after the kill", node, key_gone)
        entry = await kv.get(f"{node}-i")
        if entry.value and all(s.node_id != node
                               for s in decode_model(Instance, entry.value).shards):
            return round(time.monotonic() - began, 2)
        await asyncio.sleep(0.2)  # polling the instance: the resolution of the measurement
    # Which side failed: a key still there is a node still beating (or its TTL not applied);
    # a key gone and the instance not moved is the sweeper's.
    log.warning("scale: %s not moved within %.0f s; its heartbeat key %s", node, timeout,
                "still there" if key_gone is None else f"gone after {key_gone:.1f} s")
    return None


def busy_nodes(n: int, models: int = MODELS) -> list[int]:
    """Pure: which of the first `n` simulated nodes carry the fixed per-node load: a tenth
    (at most MAX_BUSY: the machine carries 100 streams), exactly one of them a peer of the real
    worker's model (sim-m0: index 0 modulo `models`), the rest of the other models. A worker
    hears its own model's peers (fleet.worker.prefix_adverts), so the first tenth in index
    order gave it 1 busy peer at N = 10 and 5 at N = 1,000: the workload grew, not the cost
    of a node."""
    count = min(MAX_BUSY, max(1, int(n * BUSY_FRACTION)))
    others = [i for i in range(1, n) if i % models != 0]
    return [0, *others[:count - 1]]


async def gateway_instances(port: int, model: str) -> int | None:
    """How many instances of `model` a gateway's `/v1/models/<model>` lists (None: unknown)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        answer = await client.get(f"http://127.0.0.1:{port}/v1/models/{model}")
        if not answer.is_success:
            return None
        count = answer.json().get("instances")
        return count if isinstance(count, int) else None


async def time_catalogue(stack: Stack, nc: Client, n: int,
                         timeout: float = 30.0) -> float | None:
    """Seconds from a new instance's write to every gateway's `/v1/models/<model>` counting
    it (each gateway polled every CATALOGUE_POLL_S); None past `timeout`. The instance (of
    sim-m0, on simulated node 0: alive, never killed) is deleted afterwards."""
    model = sim_model(0, MODELS)
    kv = await nc.jetstream().key_value(subjects.INSTANCES_BUCKET)
    before = await asyncio.gather(*(gateway_instances(p, model) for p in stack.gateway_ports))
    if None in before:
        log.warning("scale: a gateway's /v1/models/%s unreadable: %s", model, before)
        return None
    node = sim_node_id(0)
    placed = Instance(instance_id=f"scale-new-{n}", model=model, slots=4,
                      shards=[ShardAssignment(node_id=node, runner_id=f"{node}-r1")],
                      created_at=time.time())
    began = time.monotonic()
    await kv.put(placed.instance_id, encode(placed))

    async def sees(port: int, count: int) -> float | None:
        while time.monotonic() - began < timeout:
            if (await gateway_instances(port, model) or 0) > count:
                return time.monotonic() - began
            await asyncio.sleep(CATALOGUE_POLL_S)  # polling: the measurement's resolution
        return None

    try:
        seen = await asyncio.gather(*(sees(p, c) for p, c in zip(stack.gateway_ports, before,
                                                                strict=True)))
    finally:
        await kv.delete(placed.instance_id)
    return None if None in seen else round(max(s for s in seen if s is not None), 3)


async def time_placement(nc: Client) -> float:
    """The p50 of one placement decision over every live heartbeat, in ms."""
    nodes = await live_values(nc.jetstream(), subjects.NODES_BUCKET, NodeInfo)
    card = fault_card(sim_model(1, MODELS))
    took = []
    for _ in range(50):
        began = time.perf_counter()
        choose_node(nodes, card, time.time())
        took.append((time.perf_counter() - began) * 1e3)
    return round(statistics.median(took), 3)


async def run_design(src: Path, design: str, plan: ScalePlan, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    stack = Stack(src, design, work, servers=plan.servers)
    steps: dict[str, Any] = {}
    killed: set[str] = set()
    try:
        nc = await start_server(stack)
        for n in plan.steps:
            log.info("scale %s: N = %d", design, n)
            await add_sims(stack, nc, n)
            if "worker" not in stack.procs:
                await start_real(stack, nc, plan.gateways)
            # The nodes' placements reach every watcher (the real worker plans once a change,
            # each gateway decodes it): measured only once the table has been still a while.
            await _still(nc, subjects.INSTANCES_BUCKET, plan.settle_s)
            idle = await measure(stack, plan.window_s)
            idle["worker_instances"] = await instances_on(nc, stack.worker_node)
            busy = [sim_node_id(i) for i in busy_nodes(n)]
            await nc.publish(LOAD, orjson.dumps({"busy": busy}))
            await asyncio.sleep(2.0)  # streams and adverts start
            loaded = await measure(stack, plan.window_s)
            await nc.publish(LOAD, orjson.dumps({"busy": []}))
            step: dict[str, Any] = {"idle": idle, "load": loaded, "busy_nodes": len(busy),
                                    "placement_p50_ms": await time_placement(nc),
                                    "sweeper": await sweeper_holder(nc)}
            step["moved_alive"] = await moved_while_alive(nc, n, killed)
            step["catalogue_s"] = await time_catalogue(stack, nc, n)
            if plan.failover:
                # The last node whose instance is still on it (one moved while alive is no
                # loss to time).
                index = max(i for i in range(n) if sim_node_id(i) not in
                            {*killed, *step["moved_alive"]})
                killed.add(sim_node_id(index))
                step["failover_s"] = await time_failover(nc, index)
                step["sweeper_after"] = await sweeper_holder(nc)
                if step["failover_s"] is None:
                    log.warning("scale: N = %d: node %s not moved; the sweeper's log:\n%s", n,
                                sim_node_id(index), sweeper_log(stack))
            if step["moved_alive"]:
                log.warning("scale: N = %d: %d instances moved off nodes that lived: %s", n,
                            len(step["moved_alive"]), ",".join(step["moved_alive"][:20]))
            steps[str(n)] = step
        await nc.close()
    except BaseException:
        from bench.cli import show_logs

        show_logs(work, 15)
        raise
    finally:
        stack.stop()
    return {"design": design, "src": str(src), "steps": steps}


def _share(row: dict[str, Any] | None) -> str:
    return "-" if row is None else f"{row['cpu']:.1%}"  # the baseline has no sweeper process


def _seconds(value: object) -> object:
    return "> 60" if value is None else value  # time_failover's timeout


def table(result: dict[str, Any]) -> list[str]:
    lines = [f"### {result['design']} ({result['src']})", "",
             "| N | load | worker msgs/s | worker KB/s | worker CPU | worker RSS MB | "
             "gateway msgs/s | gateway KB/s | gateway CPU | nats CPU | sweeper CPU | "
             "placement p50 ms | catalogue s | failover s | moved alive | worker instances | "
             "load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, step in result["steps"].items():
        for phase in ("idle", "load"):
            row = step[phase]
            w, g, s = row["worker"], row.get("gateway-0", {}), row["nats"]
            lines.append(
                f"| {n} | {phase if phase == 'idle' else str(step['busy_nodes']) + ' busy'} | "
                f"{w['msgs_s']} | {w['kb_s']} | {w['cpu']:.1%} | {w['rss_mb']} | "
                f"{g.get('msgs_s', '-')} | {g.get('kb_s', '-')} | {g.get('cpu', 0):.1%} | "
                f"{s['cpu']:.1%} | {_share(row.get('sweeper'))} | "
                f"{step['placement_p50_ms'] if phase == 'idle' else ''} | "
                f"{step.get('catalogue_s', '-') if phase == 'idle' else ''} | "
                f"{_seconds(step.get('failover_s', '-')) if phase == 'idle' else ''} | "
                f"{len(step.get('moved_alive', [])) if phase == 'idle' else ''} | "
                f"{row.get('worker_instances', '')} | "
                f"{row.get('loadavg', '-')} |")
    return lines


def run_scale(quick: bool, baseline_src: Path | None, workdir: Path,
              steps: tuple[int, ...] | None = None, gateways: int | None = None,
              cluster: bool = False) -> dict[str, Any]:
    import uvloop

    plan = QUICK if quick else ScalePlan()
    if steps or gateways or cluster:
        plan = ScalePlan(steps=steps or plan.steps, gateways=gateways or plan.gateways,
                         window_s=plan.window_s, settle_s=plan.settle_s,
                         failover=plan.failover, servers=3 if cluster else 1)
    results = []
    if baseline_src is not None:
        capped = ScalePlan(steps=tuple(n for n in plan.steps if n <= BASELINE_MAX_N),
                           gateways=plan.gateways, window_s=plan.window_s,
                           settle_s=plan.settle_s, failover=plan.failover,
                           servers=plan.servers)
        results.append(uvloop.run(run_design(baseline_src, "baseline", capped,
                                             workdir / "base")))
    results.append(uvloop.run(run_design(REPO, "current", plan, workdir / "current")))
    for result in results:
        print("\n".join(["", *table(result)]))
    return {"plan": plan.__dict__, "results": results}


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--baseline-src", type=Path)
    parser.add_argument("--steps", help="comma-separated N, e.g. 10,100,1000")
    parser.add_argument("--gateways", type=int, help="G real gateways (default 1)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--workdir", type=Path, help="keep the processes' logs here")
    parser.add_argument("--cluster", action="store_true",
                        help="the 3-node cluster of ops/nats (on free ports), not one server")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    steps = tuple(int(s) for s in args.steps.split(",")) if args.steps else None
    if args.workdir:  # kept: the processes' logs (the sweeper's is sim-0.log)
        result = run_scale(args.quick, args.baseline_src, args.workdir, steps, args.gateways,
                           args.cluster)
    else:
        with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp:
            result = run_scale(args.quick, args.baseline_src, Path(tmp), steps,
                               args.gateways, args.cluster)
    out = args.out or REPO / "bench" / "results" / f"scale-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

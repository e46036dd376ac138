"""This node: a stable id kept in the data dir, the heartbeat it puts in FLEET_NODES, and how
much CPU it has to spare.

Spare CPU is measured, routing's notion of saturation: whether a runner's idle core is really
idle depends on everything else on the machine (the other runners, the worker, nats-server,
neighbours), so the worker samples the node's idle CPU (psutil, all cores) every `every_s` and
tells its loop when the figure moved by a tenth of a core or more (`sample_cores_forever`);
routing then knows whether work sent to an idle runner runs on a core nobody uses
(fleet.worker.routing). Its workers' adverts carry the same figure to other nodes.
"""

from __future__ import annotations

import asyncio
import os
import platform
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from fleet.wire.cluster import DeviceInfo, NodeInfo
from fleet.worker.state import CoresSampled

SAMPLE_S = 0.5
MOVED = 0.1  # cores: a smaller change is not worth a plan


def node_id(data_dir: Path) -> str:
    """The same id across restarts, so a restarted worker is the same node and not a ghost."""
    path = data_dir / "node_id"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    new_id = f"{socket.gethostname().split('.')[0][:24]}-{uuid.uuid4().hex[:8]}"
    new_id = "".join(c if c.isalnum() or c in "-_" else "-" for c in new_id)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new_id)
    try:
        os.link(tmp, path)  # atomic create-if-absent: two workers racing agree on one id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def devices() -> list[DeviceInfo]:
    found = [DeviceInfo(kind="cpu", name=platform.processor() or platform.machine())]
    if platform.system() == "Darwin":
        found.append(DeviceInfo(kind="metal", name="apple-gpu"))
    return found


def node_info(
    node: str,
    started_at: float,
    models: list[str],
    runners: list[str],
    blas: str | None,
    available: list[str] | None = None,
    disk_room: int | None = None,
    memory_limit: int = 0,
    memory_placed: int = 0,
    ring_address: str | None = None,
    standby_runner: bool = False,
) -> NodeInfo:
    """`memory_limit` (bytes, 0: none) caps what the node offers: the limit less
    `memory_placed`, what the models placed here take, when that is less than what is free."""
    memory = psutil.virtual_memory()
    free = memory.available
    if memory_limit > 0:
        free = min(free, max(0, memory_limit - memory_placed))
    return NodeInfo(
        node_id=node,
        hostname=socket.gethostname(),
        memory_total_bytes=min(memory.total, memory_limit) if memory_limit else memory.total,
        memory_available_bytes=free,
        cpu_count=os.cpu_count() or 1,
        devices=devices(),
        models_on_disk=models,
        models_available=sorted(set(models) | set(available or [])),
        models_disk_room_bytes=disk_room,
        runners=runners,
        ring_address=ring_address,
        blas=blas,
        standby_runner=standby_runner,
        started_at=started_at,
        at=time.time(),
    )


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the ring's listener binds it later)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def spare_cores(busy_percent: float, cores: int) -> float:
    return round(cores * max(0.0, 100.0 - busy_percent) / 100.0, 2)


async def sample_cores_forever(tell: Callable[[CoresSampled], None],
                               every_s: float = SAMPLE_S) -> None:
    cores = psutil.cpu_count() or 1
    psutil.cpu_percent(interval=None)  # the first call only starts the interval
    last: float | None = None
    while True:
        await asyncio.sleep(every_s)  # the sampling period, not synchronisation
        spare = spare_cores(psutil.cpu_percent(interval=None), cores)
        if last is None or abs(spare - last) >= MOVED:
            last = spare
            tell(CoresSampled(spare))

"""How much CPU this node has to spare, measured: routing's notion of saturation.

Whether a runner's idle core is really idle depends on everything else on the machine (the
other runners, the worker, nats-server, neighbours), so the worker samples the node's idle
CPU (psutil, all cores) every `every_s` and tells its loop when the figure moved by a tenth of
a core or more; routing then knows whether work sent to an idle runner runs on a core nobody
uses (fleet.worker.routing). Its workers' adverts carry the same figure to other nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import psutil

from fleet.worker.state import CoresSampled

SAMPLE_S = 0.5
MOVED = 0.1  # cores: a smaller change is not worth a plan


def spare_cores(busy_percent: float, cores: int) -> float:
    return round(cores * max(0.0, 100.0 - busy_percent) / 100.0, 2)


async def sample_forever(tell: Callable[[CoresSampled], None], every_s: float = SAMPLE_S) -> None:
    cores = psutil.cpu_count() or 1
    psutil.cpu_percent(interval=None)  # the first call only starts the interval
    last: float | None = None
    while True:
        await asyncio.sleep(every_s)  # the sampling period, not synchronisation
        spare = spare_cores(psutil.cpu_percent(interval=None), cores)
        if last is None or abs(spare - last) >= MOVED:
            last = spare
            tell(CoresSampled(spare))

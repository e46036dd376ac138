"""A runner's ring: joining its group over mx.distributed, and rank 0's step plans to the others.

mlx's ring backend reads its rank and every rank's address from MLX_RANK and a JSON hostfile
(MLX_HOSTFILE), as `mlx.launch --backend ring` sets them, and `init` blocks until every peer is
connected, for ever when one never comes, holding the GIL. So a forked watchdog gives up
after the group's `connect_timeout_s`: it reports the runner failed, naming the ranks it
waited for, and kills it.

A plan is bytes on the wire: rank 0 sends their length, then the bytes, as two `all_sum`s in
which the other ranks add zeros (a plain step, nothing to tell, is the length 0 alone). Every
collective runs on mlx-lm's generation stream, the stream the model's own sends and receives
run on, so every rank sees them in one order.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from fleet.wire.codec import decode_model, encode
from fleet.wire.ring import GroupSpec, StepPlan


class RingFailed(Exception):
    """The ring did not form: the runner fails, saying which peers never came."""


def lost(exc: BaseException) -> bool:
    """Whether an mlx error is the ring's (a peer closed its socket)."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("[ring]")


def join_ring(group: GroupSpec, last_words: Callable[[str], None]) -> Any:
    """This rank's mx.distributed group. mlx's `init` holds the GIL while it waits for its
    peers, so no thread of this process can time it out: a forked watchdog does. When the
    ring has not formed within `connect_timeout_s`, it calls `last_words` with the reason
    (the runner's Failed report) and SIGKILLs this process."""
    hostfile = os.path.join(tempfile.mkdtemp(prefix="fleet-ring-"), "hosts.json")
    with open(hostfile, "w") as out:
        json.dump([[address] for address in group.ring], out)
    os.environ["MLX_RANK"] = str(group.rank)
    os.environ["MLX_HOSTFILE"] = hostfile
    others = ", ".join(
        f"rank {rank} at {address}" for rank, address in enumerate(group.ring)
        if rank != group.rank
    )
    reason = (f"the ring did not form within {group.connect_timeout_s:.0f} s: rank "
              f"{group.rank} waited for {others}")
    with _watchdog(group.connect_timeout_s, lambda: last_words(reason)):
        ring = mx.distributed.init(strict=True, backend="ring")
        # Every rank is connected only once a collective has gone round.
        mx.eval(mx.distributed.all_sum(mx.array([1]), group=ring, stream=mx.cpu))
    if ring.size() != group.world_size or ring.rank() != group.rank:
        raise RingFailed(f"joined as rank {ring.rank()} of {ring.size()}, not {group.rank} of "
                         f"{group.world_size}")
    return ring


WATCHDOG_POLL_S = 0.1  # how soon the watchdog follows its runner when the runner is killed


@contextlib.contextmanager
def _watchdog(seconds: float, last_words: Callable[[], None]) -> Iterator[None]:
    """Unless the block ends within `seconds`, a forked child says `last_words` (it shares
    the report pipe, which nothing else writes to meanwhile) and SIGKILLs this process.

    The child holds the runner's report pipe open, and the worker learns that a runner ended
    from that pipe's end: so the child leaves at once when the runner dies (its parent is no
    longer this process). A worker that kills a shard stuck in a ring that will not form (a
    rank moved) then sees it gone at once, not after the ring timeout (120 s)."""
    parent = os.getpid()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if os.getppid() != parent:
                    return  # the runner was killed: nothing to say, nobody to kill
                time.sleep(WATCHDOG_POLL_S)  # a watchdog's timer (nothing to wait on)
            last_words()
            os.kill(parent, signal.SIGKILL)
        finally:
            os._exit(0)
    try:
        yield
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


class PlanChannel:
    """Rank 0 sends each step's plan; every other rank receives it, in step order."""

    def __init__(self, ring: Any) -> None:
        self._ring = ring

    def _sum(self, values: mx.array) -> mx.array:
        total = mx.distributed.all_sum(values, group=self._ring, stream=generation_stream)
        mx.eval(total)
        return total

    def send(self, plan: StepPlan) -> None:
        """A plain step (nothing admitted, cancelled or stopped) is a length of 0 alone."""
        body = encode(plan) if plan != StepPlan() else b""
        self._sum(mx.array([len(body)], dtype=mx.int32))
        if body:
            self._sum(mx.array(np.frombuffer(body, dtype=np.uint8)))

    def receive(self) -> StepPlan:
        (length,) = self._sum(mx.zeros((1,), dtype=mx.int32)).tolist()
        if length == 0:
            return StepPlan()
        body = self._sum(mx.zeros((int(length),), dtype=mx.uint8))
        return decode_model(StepPlan, bytes(np.array(body, copy=False)))

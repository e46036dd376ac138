"""One gateway's cost per token while other gateways carry ten times its traffic (issue 22).

A gateway is sent only the events of its own requests (a core subscription per task, with the
JetStream read-back for gaps), so what it spends per token should not depend on what the other
gateways of the fleet carry. This measures it from outside, with psutil CPU times:

- one `fleet up --processes split` serving the fault engine (its gateway, a process of its own,
  is "gateway 0") and OTHERS more `fleet gateway` processes on the same nats-server;
- phase `alone`: gateway 0 carries MINE paced streams, the others are idle;
- phase `beside`: the same on gateway 0 while the others together carry TIMES as many tokens;
- phase `alone again`, so the noise of a shared machine shows in the two `alone` rows.

Each stream is a chat of STREAM_TOKENS tokens paced at RATE tokens a second (the fault engine's
`tokens_per_s`), a new one as soon as one ends; tokens are counted from each answer's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from bench.fleet_stack import FleetStack
from bench.plumbing_rate import MODEL, seed_fault_card
from bench.procs import free_port

RATE = 100  # tokens a second per stream
STREAM_TOKENS = 300
MINE = 4  # gateway 0's streams
TIMES = 10  # the other gateways carry this many times gateway 0's tokens, together
OTHERS = 3
STREAM_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SharePlan:
    window_s: float = 20.0
    mine: int = MINE
    times: int = TIMES


QUICK = SharePlan(window_s=5.0)


async def _stream(client: httpx.AsyncClient, base_url: str) -> int:
    body = {"model": MODEL, "max_tokens": STREAM_TOKENS, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user",
                          "content": f"tokens:{STREAM_TOKENS} tokens_per_s:{RATE}"}]}
    tail = b""
    async with client.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for piece in response.aiter_bytes():
            tail = (tail + piece)[-4096:]
    usages = [frame.rsplit(b"data: ", 1)[-1] for frame in tail.split(b"\n\n")
              if b'"usage":{' in frame]
    return int(orjson.loads(usages[-1])["usage"]["completion_tokens"]) if usages else 0


async def _carry(base_url: str, streams: int, until: float, counts: list[int],
                 errors: list[str]) -> None:
    """`streams` loops of paced chats on one gateway until the monotonic time `until`."""
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=httpx.Timeout(STREAM_TIMEOUT_S), limits=limits) as client:
        async def loop() -> None:
            while time.monotonic() < until:
                try:
                    # Awaited first: `counts[0] += await ...` reads the count before the
                    # await, and the streams of this loop would overwrite each other's.
                    got = await asyncio.wait_for(_stream(client, base_url), STREAM_TIMEOUT_S)
                    counts[0] += got
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

        await asyncio.gather(*(loop() for _ in range(streams)))


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def _phase(bases: list[str], gateways: list[psutil.Process], plan: SharePlan,
                 beside: bool) -> dict[str, Any]:
    """Gateway 0 carries plan.mine streams; with `beside`, the others carry plan.times as many
    streams between them. The window counts the tokens of the streams that ended in it, and
    every stream that starts in it ends in it or just after (one stream's length, 3 s)."""
    others = plan.mine * plan.times if beside else 0
    per_other = [others // len(bases[1:]) + (i < others % len(bases[1:]))
                 for i in range(len(bases[1:]))]
    before = [_cpu(g) for g in gateways]
    counts = [[0] for _ in bases]
    errors: list[str] = []
    began = time.monotonic()
    until = began + plan.window_s
    await asyncio.gather(
        _carry(bases[0], plan.mine, until, counts[0], errors),
        *(_carry(base, n, until, counts[i + 1], errors)
          for i, (base, n) in enumerate(zip(bases[1:], per_other, strict=True)) if n))
    wall = time.monotonic() - began
    spent = [_cpu(g) - b for g, b in zip(gateways, before, strict=True)]
    tokens = [c[0] for c in counts]
    return {
        "streams": [plan.mine, *per_other],
        "tokens": tokens, "wall_s": round(wall, 2),
        "tok_s": [round(t / wall, 1) for t in tokens],
        "gateway0_us_per_token": round(1e6 * spent[0] / max(tokens[0], 1), 1),
        "gateway0_cores": round(spent[0] / wall, 3),
        "others_us_per_token": [round(1e6 * s / max(t, 1), 1)
                                for s, t in zip(spent[1:], tokens[1:], strict=True)]
        if beside else [],
        "load_1m": round(os.getloadavg()[0], 2),
        "errors": len(errors), "first_errors": errors[:3],
    }


async def _gateway_up(base_url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"a gateway exited; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                models = await client.get(f"{base_url}/models")
                if models.is_success and MODEL in models.text:
                    return
            await asyncio.sleep(0.2)  # polling a starting process, bounded by the deadline
    raise TimeoutError(f"a gateway did not serve {MODEL} in time; see {log}")


async def run_share(workdir: Path, plan: SharePlan) -> dict[str, Any]:
    data_dir = workdir / "fleet-data"
    seed_fault_card(data_dir)
    env = {**os.environ, "FLEET_UP_PROCESSES": "split", "OPENBLAS_NUM_THREADS": "1"}
    stack = FleetStack(data_dir, [MODEL], 64, env)
    await stack.start()
    extra: list[subprocess.Popen[bytes]] = []
    try:
        found = stack.processes()
        gateways = [found["gateway"]]
        bases = [stack.base_url]
        for index in range(1, OTHERS + 1):
            gw_dir = workdir / f"gateway-{index}"
            seed_fault_card(gw_dir)
            port = free_port()
            log = gw_dir / "gateway.log"
            with log.open("ab") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "fleet.cli", "--data-dir", str(gw_dir),
                     "--log-level", "warning", "gateway", "--port", str(port)],
                    env={**env, "FLEET_NATS_URL": stack.nats_url}, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
            extra.append(process)
            base = f"http://127.0.0.1:{port}/v1"
            await _gateway_up(base, process, log)
            gateways.append(psutil.Process(process.pid))
            bases.append(base)
        warm = SharePlan(window_s=2.0, mine=2, times=1)
        await _phase(bases, gateways, warm, beside=True)  # every gateway has served once
        out: dict[str, Any] = {"plan": plan.__dict__, "rate_per_stream": RATE,
                               "gateways": len(bases)}
        for name, beside in (("alone", False), ("beside", True), ("alone_again", False)):
            out[name] = await _phase(bases, gateways, plan, beside)
        alone = min(out["alone"]["gateway0_us_per_token"],
                    out["alone_again"]["gateway0_us_per_token"])
        out["ratio"] = round(out["beside"]["gateway0_us_per_token"] / max(alone, 1e-9), 2)
        return out
    finally:
        for process in extra:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
        await stack.stop()


def share_table(result: dict[str, Any]) -> list[str]:
    lines = [f"gateway share ({result['gateways']} gateways, streams of {STREAM_TOKENS} tokens "
             f"at {result['rate_per_stream']} tok/s): gateway 0's CPU per token"]
    for name in ("alone", "beside", "alone_again"):
        row = result[name]
        others = round(sum(row["tok_s"][1:]), 1)
        lines.append(
            f"  {name:<12} gateway 0: {row['tok_s'][0]:>7} tok/s, "
            f"{row['gateway0_us_per_token']:>6} us/token ({row['gateway0_cores']} of a core); "
            f"others: {others:>7} tok/s {row['others_us_per_token']} us/token; "
            f"load {row['load_1m']}; errors {row['errors']}")
    lines.append(f"  beside / alone (the lower alone): x{result['ratio']} (target <= 1.2)")
    return lines

"""`fleet bench --only vision`: chats with repeated images through `fleet up`, the vision cache
off and on, and on a second node that never saw the images; and the image fetch per MB.

Workload: IMAGES distinct noise PNGs (SIDE x SIDE), QUESTIONS questions about each, sent as
data URLs through POST /v1/chat/completions (streamed, greedy, MAX_TOKENS new tokens) by
CLIENTS concurrent clients, question-major (every image once, then every image again...), so
the first round encodes and the later rounds can hit. TTFT is the first content chunk's
arrival. Runs:
- `off`: FLEET_VISION_CACHE_MB=0: every request encodes its image.
- `on`: the cache on (the default budget), a fresh stack.
- `second node`: on the `on` stack's NATS, a fresh worker with its own empty data dir takes
  the model over (the first node's instance removed) and the workload runs again: its runner
  never encoded these images; hits come from FLEET_VISION, fetched before dispatch.
Image fetch per MB: the gateway's http fetch (fleet.gateway.image_fetch) from a loopback
server, and a node's read of FLEET_IMAGES (ObjectBucket.get_to_file), 1-8 MB noise PNGs, the
median of FETCH_REPS reads each.
"""

from __future__ import annotations

import asyncio
import base64
import io
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import orjson
from nats.aio.client import Client

from bench.fleet_stack import FleetStack, seed_data_dir, wait_runner_ready
from bench.fresh_worker import _noise_png, _wait_node
from bench.procs import stop_group
from fleet.bus.objects import ObjectBucket
from fleet.models.catalog import get_card
from fleet.models.store import ensure_model
from fleet.placement import find_instance, place, remove
from fleet.wire import subjects

MODEL = "tiny-vlm"
SIDE, MAX_TOKENS, CLIENTS = 384, 8, 4
FULL, QUICK = (16, 4), (4, 2)  # (images, questions)
FETCH_MB = (1, 4, 8)
FETCH_REPS = 5  # the median of as many reads: one read on a shared box is noise


async def _timed(call: Awaitable[object]) -> float:
    began = time.perf_counter()
    await call
    return time.perf_counter() - began


def noise_png(side: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def workload(images: int, questions: int, tag: str) -> list[tuple[int, str, str]]:
    """(image index, data URL, question), question-major. The same images in every run."""
    urls = [f"data:image/png;base64,{base64.b64encode(noise_png(SIDE, i)).decode()}"
            for i in range(images)]
    return [(i, urls[i], f"{tag} question {q}: what is in picture {i}?")
            for q in range(questions) for i in range(images)]


async def one_chat(http: httpx.AsyncClient, url: str, question: str) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": question}]}]}
    began = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with http.stream("POST", "/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"{response.status_code} {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - began
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "total_s": time.perf_counter() - began,
            "cached": details.get("cached_images", 0)}


async def run_workload(base_url: str, load: list[tuple[int, str, str]]) -> dict[str, Any]:
    queue = list(reversed(load))
    rows: list[dict[str, Any]] = []

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            _, url, question = queue.pop()
            rows.append(await one_chat(http, url, question))

    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(CLIENTS)))
    wall = time.perf_counter() - began
    ok = [r for r in rows if "error" not in r and r["ttft_s"] is not None]
    hits = [r["ttft_s"] for r in ok if r["cached"]]
    misses = [r["ttft_s"] for r in ok if not r["cached"]]

    def p50(values: list[float]) -> float | None:
        return round(statistics.median(values) * 1000, 1) if values else None

    return {"requests": len(load), "errors": len(rows) - len(ok),
            "first_error": next((r["error"] for r in rows if "error" in r), None),
            "requests_per_s": round(len(load) / wall, 2),
            "ttft_p50_ms": p50([r["ttft_s"] for r in ok]),
            "ttft_p50_hit_ms": p50(hits), "ttft_p50_miss_ms": p50(misses),
            "cached_images": sum(r["cached"] for r in ok)}


async def second_node(stack: FleetStack, nc: Client, path: Path, workdir: Path,
                      env: dict[str, str], load: list[tuple[int, str, str]]) -> dict[str, Any]:
    """A fresh worker takes the model over; the workload again, through the same gateway."""
    data_dir = workdir / "second-node"
    seed_data_dir(data_dir, {MODEL: path}, {})
    node = f"bench-vision-{secrets.token_hex(4)}"
    (data_dir / "node_id").write_text(node)
    began = time.perf_counter()
    with (data_dir / "worker.log").open("ab") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "--data-dir", str(data_dir), "--log-level",
             "warning", "worker", "--no-auto-place"], env={**env, "FLEET_NATS_URL": stack.nats_url},
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        await _wait_node(nc, node, began + 120)
        js = nc.jetstream()
        if (old := await find_instance(js, MODEL)) is not None:
            await remove(js, old.instance_id)
        await place(js, get_card(MODEL, data_dir), node_id=node, slots=CLIENTS)
        await wait_runner_ready(nc, MODEL, time.monotonic() + 300, node_id=node)
        return await run_workload(stack.base_url, load)
    finally:
        await asyncio.to_thread(stop_group, worker, 5.0)


async def run_stack(path: Path, workdir: Path, env: dict[str, str], cache_mb: str | None,
                    load: list[tuple[int, str, str]], then_second: bool) -> dict[str, Any]:
    data_dir = workdir / "data"
    seed_data_dir(data_dir, {MODEL: path}, {})
    stack_env = dict(env) | ({"FLEET_VISION_CACHE_MB": cache_mb} if cache_mb else {})
    stack = FleetStack(data_dir, [MODEL], CLIENTS, stack_env)
    nc = await stack.start()
    try:
        # An image not in the workload, once: the first request's costs are nobody's.
        await run_workload(stack.base_url, [(0, noise_url(9999), "warm up")])
        result = {"first_node": await run_workload(stack.base_url, load)}
        if then_second:
            result["second_node"] = await second_node(stack, nc, path, workdir, env, load)
        result["object_store_fetch"] = await store_fetch(nc, workdir)
        return result
    finally:
        await stack.stop()


def noise_url(seed: int) -> str:
    return f"data:image/png;base64,{base64.b64encode(noise_png(SIDE, seed)).decode()}"


async def store_fetch(nc: Client, workdir: Path) -> list[dict[str, Any]]:
    """A node's read of an image from FLEET_IMAGES, per MB."""
    bucket = ObjectBucket(nc, subjects.IMAGES_BUCKET, timeout=30)
    rows = []
    for mb in FETCH_MB:
        image = await asyncio.to_thread(_noise_png, mb * 1000 * 1000)
        sha = await bucket.put_by_hash(image)
        took = statistics.median([await _timed(bucket.get_to_file(sha, workdir / f"got-{mb}"))
                                  for _ in range(FETCH_REPS)])
        rows.append({"mb": round(len(image) / 1e6, 2), "ms": round(took * 1000, 1),
                     "ms_per_mb": round(took * 1000 / (len(image) / 1e6), 1)})
    return rows


async def http_fetch() -> list[dict[str, Any]]:
    """The gateway's fetch of an http image URL from a loopback server, per MB."""
    from fleet.gateway.image_fetch import fetch_image

    images = {mb: _noise_png(mb * 1000 * 1000) for mb in FETCH_MB}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = images[int(self.path.strip("/"))]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    rows = []
    try:
        for mb, image in images.items():
            url = f"http://127.0.0.1:{httpd.server_address[1]}/{mb}"
            took = statistics.median([
                await _timed(fetch_image(url, "private", max_bytes=16 * 1024**2))
                for _ in range(FETCH_REPS)])
            rows.append({"mb": round(len(image) / 1e6, 2), "ms": round(took * 1000, 1),
                         "ms_per_mb": round(took * 1000 / (len(image) / 1e6), 1)})
    finally:
        httpd.shutdown()
        httpd.server_close()
    return rows


async def run_vision(models_dir: Path, workdir: Path, env: dict[str, str],
                     quick: bool) -> dict[str, Any]:
    path = ensure_model(get_card(MODEL), models_dir)
    images, questions = QUICK if quick else FULL
    load = workload(images, questions, "q")
    return {
        "images": images, "questions": questions, "side": SIDE, "clients": CLIENTS,
        "max_tokens": MAX_TOKENS,
        "off": await run_stack(path, workdir / "off", env, "0", load, then_second=False),
        "on": await run_stack(path, workdir / "on", env, None, load, then_second=True),
        "http_fetch": await http_fetch(),
    }


def vision_table(result: dict[str, Any]) -> list[str]:
    lines = ["", f"vision: {MODEL}, {result['images']} images x {result['questions']} "
             f"questions, {result['side']}px PNGs, {result['clients']} clients, "
             f"{result['max_tokens']} tokens",
             f"  {'run':<22} {'req/s':>7} {'TTFT p50':>9} {'hit p50':>8} {'miss p50':>9} "
             f"{'cached':>7} {'errors':>7}"]
    runs = [("cache off", result["off"]["first_node"]), ("cache on", result["on"]["first_node"]),
            ("on, second node", result["on"].get("second_node"))]
    for name, row in runs:
        if row:
            lines.append(f"  {name:<22} {row['requests_per_s']:>7} {row['ttft_p50_ms']!s:>9} "
                         f"{row['ttft_p50_hit_ms']!s:>8} {row['ttft_p50_miss_ms']!s:>9} "
                         f"{row['cached_images']:>7} {row['errors']:>7}")
    for name, rows in (("gateway http fetch", result["http_fetch"]),
                       ("node FLEET_IMAGES read", result["on"]["object_store_fetch"])):
        lines.append(f"  {name}: " + ", ".join(
            f"{r['mb']} MB {r['ms']} ms ({r['ms_per_mb']} ms/MB)" for r in rows))
    return lines

"""Gateway fixtures: the app in-process (httpx over ASGI, or uvicorn on a socket bound here),
a provisioned nats-server, and a stand-in worker that answers tasks with scripted events."""

from __future__ import annotations

import asyncio
import io
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import uvicorn
from gateway_helpers import StandInWorker
from nats.aio.client import Client
from starlette.applications import Starlette

from fleet.commands.gateway import build_app
from fleet.config import Settings, load_settings


@pytest.fixture
def settings(tmp_path: Path, nats_url: str) -> Settings:
    return replace(
        load_settings({"nats_url": nats_url, "data_dir": tmp_path / "data"}, env={}),
        gateway_timeout_s=10.0,
        gateway_max_body_bytes=64 * 1024,
    )


@pytest.fixture
def nc(provisioned_nc: Client) -> Client:
    return provisioned_nc


# A gateway's shutdown is quick (its connect loop is bounded at 5 s); one that takes longer is
# a bug that should fail its test at once, not hold an xdist worker until pytest-timeout
# (300 s: seen twice in one run of the suite).
SHUTDOWN_LIMIT_S = 30.0


@pytest.fixture
async def app(settings: Settings, nc: Client) -> AsyncIterator[Starlette]:
    application = build_app(settings)
    lifespan = application.router.lifespan_context(application)
    await lifespan.__aenter__()
    yield application
    try:
        async with asyncio.timeout(SHUTDOWN_LIMIT_S):
            await lifespan.__aexit__(None, None, None)
    except TimeoutError:
        stacks = io.StringIO()
        for task in asyncio.all_tasks():
            task.print_stack(limit=8, file=stacks)
        pytest.fail(f"the gateway did not shut down within {SHUTDOWN_LIMIT_S:.0f} s; its "
                    f"tasks:\n{stacks.getvalue()}")


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http


@pytest.fixture
async def served(app: Starlette) -> AsyncIterator[str]:
    """The app on a real socket: needed where a client must hang up mid-stream."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # connections queue in the backlog until uvicorn accepts: no readiness poll
    config = uvicorn.Config(app, lifespan="off", log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    await serving
    sock.close()


@pytest.fixture
def worker(nc: Client) -> StandInWorker:
    return StandInWorker(nc, "tiny-llm")

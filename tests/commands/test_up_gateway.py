"""`fleet up --processes split`'s gateway child (fleet/commands/up_gateway.py): the settings it
is given read back as the same settings, the exit status passed on, and a stop ends the child
(a stand-in child: no gateway needed to own one)."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import psutil
import pytest

import fleet.commands.up_gateway
from fleet.commands.up_gateway import exit_status, gateway_process, settings_env
from fleet.config import load_settings


@pytest.mark.parametrize("flags", [
    {},
    {"nats_url": "nats://a:1,nats://b:2", "api_keys": "k1,k2", "standby_runner": False,
     "gateway_port": 0, "image_fetch": "private", "nats_creds": "/x/gateway.creds",
     "gateway_timeout_s": 2.5, "up_processes": "split"},
])
def test_a_childs_environment_gives_back_the_same_settings(
    flags: dict[str, object], tmp_path: Path
) -> None:
    settings = load_settings({"data_dir": tmp_path, **flags}, env={})
    assert load_settings(env=settings_env(settings)) == settings


@pytest.mark.parametrize(("returncode", "status"), [
    (3, 3),
    (1, 1),
    (0, 1),  # a clean exit while it should have served is still a failure
    (-9, 137),  # SIGKILL, as a shell says it
    (-15, 143),
])
def test_the_exit_status_passed_on(returncode: int, status: int) -> None:
    assert exit_status(returncode) == status


async def test_a_stop_ends_the_child(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(fleet.commands.up_gateway, "gateway_command",
                        lambda fd: [sys.executable, "-c", "import time; time.sleep(600)"])
    started = asyncio.Event()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        running = asyncio.create_task(gateway_process(
            load_settings({"data_dir": tmp_path}, env={}), sock, started))
        await asyncio.wait_for(started.wait(), 30)
        [child] = [p for p in psutil.Process().children() if "sleep(600)" in p.cmdline()[-1]]
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, 30)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE

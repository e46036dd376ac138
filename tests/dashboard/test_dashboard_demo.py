"""`fleet demo` names the dashboard's URL as soon as its stack is up (before the models load),
and that URL serves the page."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.commands.test_exits import Command, free_port

pytestmark = pytest.mark.timeout(240)


def test_fleet_demo_prints_the_dashboards_url(tmp_path: Path) -> None:
    port = free_port()
    demo = Command(tmp_path, "demo", FLEET_GATEWAY_PORT=str(port), FLEET_NATS_PORT="0")
    try:
        demo.wait_for_line("/ui\n", timeout=180)
        [url] = [line.split("dashboard ", 1)[1].strip() for line in demo.log().splitlines()
                 if "  dashboard http://" in line]
        assert url.endswith(f":{port}/ui"), url
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200 and "API key" in page.text
    finally:
        demo.kill()

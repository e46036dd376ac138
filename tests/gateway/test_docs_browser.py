"""/docs in a real browser (Debian's chromium): Swagger UI draws the gateway's OpenAPI document
from files the gateway serves itself (nothing outside is reachable here, so a CDN reference
would leave the page blank), and its "Try it out" calls the gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.bus.embedded import EmbeddedNats
from tests.bus.cluster import free_port
from tests.commands.test_exits import Command
from tests.dashboard.browser import browser, wait

pytestmark = pytest.mark.timeout(300)


def operation(driver: Any, method: str, path: str) -> Any:
    """The operation block of `method path` (Swagger UI puts zero-width spaces in the shown
    path, so the block is found by its data-path)."""
    for block in driver.find_elements("css selector", f".opblock.opblock-{method}"):
        if block.find_elements("css selector", f'[data-path="{path}"]'):
            return block
    raise AssertionError(f"no {method.upper()} {path} on the page")


def test_docs_draws_every_route_and_try_it_out_calls_the_gateway(
    tmp_path: Path, nats_server: EmbeddedNats,
) -> None:
    port = free_port()
    gateway = Command(tmp_path, "gateway", "--nats-url", nats_server.url, "--port", str(port))
    driver = browser()
    try:
        gateway.wait_for_line("gateway listening on", timeout=60)
        driver.get(f"http://127.0.0.1:{port}/docs")
        wait(driver, lambda d: d.find_elements("css selector", ".opblock"), 60, "the operations")
        assert "Fleet" in driver.find_element("css selector", ".info .title").text
        paths = {e.get_attribute("data-path")
                 for e in driver.find_elements("css selector", "[data-path]")}
        assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models",
                "/v1/images/generations", "/v1/tasks/{task_id}/events", "/health"} <= paths

        health = operation(driver, "get", "/health")
        health.find_element("css selector", ".opblock-summary").click()
        wait(driver, lambda d: health.find_elements("css selector", ".try-out__btn"), 20,
             "the Try it out button")
        health.find_element("css selector", ".try-out__btn").click()
        wait(driver, lambda d: health.find_elements("css selector", ".execute"), 20,
             "the Execute button")
        health.find_element("css selector", ".execute").click()
        status = wait(driver, lambda d: health.find_elements(
            "css selector", ".live-responses-table tr.response .response-col_status"), 30,
            "the response")
        assert status[0].text.strip().startswith("200"), status[0].text
        body = health.find_element("css selector", ".live-responses-table .microlight").text
        assert '"status"' in body
    finally:
        driver.quit()
        gateway.kill()

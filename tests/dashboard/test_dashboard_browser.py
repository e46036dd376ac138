"""The dashboard in a real browser against a real `fleet up` (tiny-llm and tiny-flux2, API
keys on): the key prompt, the fleet page with its node and a ready runner, a playground chat
streaming into its task page with tokens and a waterfall of the runner's spans, an image from
the playground, removing an instance, and a second node that is SIGKILLed leaving the page
within its heartbeat TTL. Each page's screenshot goes to docs/screenshots/ (the README's)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.commands.test_exits import Command, free_port
from tests.dashboard.browser import browser, screenshot, wait
from tests.integration.harness import WorkerProcess, seed_models

KEY = "fk-dashboard-test-key"
NODE_TTL_S = 15.0  # fleet/worker/heartbeat.py NODE_TTL_S, the FLEET_NODES max age
FEED_TICK_S = 1.0
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_llm_dir: Path, tiny_flux2_dir: Path
) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("dashboard")
    seed_models(root / "data", {"tiny-llm": tiny_llm_dir, "tiny-flux2": tiny_flux2_dir})
    http_port, nats_port = free_port(), free_port()
    up = Command(root, "up", "--models", "tiny-llm,tiny-flux2", "--port", str(http_port),
                 "--nats-port", str(nats_port), FLEET_API_KEYS=KEY)
    try:
        up.wait_for_line("fleet up: NATS", timeout=180)
        yield {"base": f"http://127.0.0.1:{http_port}",
               "nats": f"nats://127.0.0.1:{nats_port}", "root": root, "up": up}
    finally:
        up.kill()


@pytest.fixture(scope="module")
def page(stack: dict[str, Any]) -> Iterator[Any]:
    driver = browser()
    try:
        yield driver
    finally:
        driver.quit()


def text(driver: Any) -> str:
    return str(driver.find_element("tag name", "body").text)


def css(driver: Any, selector: str) -> list[Any]:
    return list(driver.find_elements("css selector", selector))


def go(driver: Any, stack: dict[str, Any], where: str) -> None:
    driver.get(f"{stack['base']}/ui#/{where}")


def test_without_a_key_the_page_asks_for_one_then_shows_the_fleet(
    page: Any, stack: dict[str, Any]
) -> None:
    go(page, stack, "fleet")
    dialog = wait(page, lambda d: (css(d, "#key-dialog[open]") or [None])[0], 20, "key prompt")
    assert "API key needed" in dialog.text
    screenshot(page, "dashboard-key")
    page.find_element("id", "key-input").send_keys(KEY)
    page.find_element("css selector", "#key-form button").click()
    wait(page, lambda d: css(d, "#nodes .node"), 30, "a node")
    wait(page, lambda d: css(d, '.runner[data-state="ready"] .states li.lit'), 120,
         "a ready runner with its state lit")
    lit = {e.text for e in css(page, ".runner .states li.lit")}
    assert "ready" in lit, lit
    assert css(page, '.runner[data-state="ready"]')
    screenshot(page, "dashboard-fleet")


def test_a_playground_chat_streams_and_its_task_page_shows_tokens_and_the_trace(
    page: Any, stack: dict[str, Any]
) -> None:
    go(page, stack, "playground")
    model = wait(page, lambda d: (css(d, '#pg-model option[value="tiny-llm"]') or [None])[0],
                 20, "the model list")
    model.click()
    page.find_element("id", "pg-send").click()
    wait(page, lambda d: d.find_element("id", "pg-answer").text.strip(), 60, "streamed tokens")
    link = wait(page, lambda d: (css(d, "#pg-task-link") or [None])[0], 30, "the task link")
    wait(page, lambda d: d.find_element("id", "pg-note").text == "done", 60,
         "the end of the answer")
    answer = page.find_element("id", "pg-answer").text
    screenshot(page, "dashboard-playground-chat")
    task_id = link.text
    link.click()
    wait(page, lambda d: d.find_element("id", "task-text").text.strip() == answer.strip(), 30,
         "the task's tokens, the same as the answer")
    wait(page, lambda d: css(d, "#task-trace .span-row"), 30, "the trace waterfall")
    services = {e.get_attribute("data-service") for e in css(page, "#task-trace .span-row")}
    assert any("runner" in (s or "") for s in services), services
    assert task_id in text(page)
    screenshot(page, "dashboard-task")
    go(page, stack, "tasks")
    wait(page, lambda d: css(d, f'tr[data-task="{task_id}"]'), 20, "the task in the list")
    screenshot(page, "dashboard-tasks")
    go(page, stack, "queues")
    wait(page, lambda d: css(d, 'tr[data-model="tiny-llm"]'), 20, "tiny-llm's queue")
    screenshot(page, "dashboard-queues")


def test_an_image_from_the_playground_appears(page: Any, stack: dict[str, Any]) -> None:
    go(page, stack, "playground")
    model = wait(page, lambda d: (css(d, '#pg-model option[value="tiny-flux2"]') or [None])[0],
                 20, "the model list")
    model.click()
    prompt = page.find_element("id", "pg-prompt")
    prompt.clear()
    prompt.send_keys("a lighthouse at dusk")
    page.find_element("id", "pg-send").click()
    final = wait(page, lambda d: [i for i in css(d, "#pg-images img.final")
                                  if d.execute_script(
                                      "return arguments[0].complete && arguments[0].naturalWidth",
                                      i)], 120, "the final image")
    assert final
    screenshot(page, "dashboard-playground-image")


def test_a_node_that_stops_leaves_the_page_within_its_heartbeat_ttl(
    page: Any, stack: dict[str, Any]
) -> None:
    worker = WorkerProcess(stack["nats"], stack["root"] / "second-node").start()
    try:
        go(page, stack, "fleet")
        wait(page, lambda d: len(css(d, "#nodes .node")) == 2, 60, "the second node")
        node_id = worker.node_id
        assert css(page, f'[data-node="{node_id}"]')
        worker.kill()
        killed = time.monotonic()
        wait(page, lambda d: not css(d, f'[data-node="{node_id}"]'),
             NODE_TTL_S + 3 * FEED_TICK_S + 2, "the node leaving")
        print(f"node gone from the page {time.monotonic() - killed:.1f} s after SIGKILL")
    finally:
        worker.kill()


def test_removing_an_instance_is_reflected(page: Any, stack: dict[str, Any]) -> None:
    go(page, stack, "fleet")
    card = wait(page, lambda d: [c for c in css(d, ".instance")
                                 if "tiny-flux2" in c.text], 30, "the image instance")[0]
    instance_id = card.get_attribute("data-instance")
    card.find_element("css selector", "button.danger").click()
    page.switch_to.alert.accept()
    wait(page, lambda d: not css(d, f'[data-instance="{instance_id}"]'), 30,
         "the instance gone")
    screenshot(page, "dashboard-fleet-removed")

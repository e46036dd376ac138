"""The dashboard in a real browser against a real `fleet up` (tiny-llm and tiny-flux2, a keys
file with an operator and a tenant): the key prompt, the fleet page with its node and a ready
runner, a playground chat streaming into its task page with tokens and a waterfall of the
runner's spans, an image from the playground, a second node that is SIGKILLed leaving the page
within its heartbeat TTL, removing an instance, a tenant key that sees neither the actions nor
the operator's tasks, and 50 nodes with 1,000 tasks drawn within a bounded wait. Each page's
screenshot is saved (tests/dashboard/browser.py: to docs/screenshots/, the README's, when run
with FLEET_SCREENSHOTS=docs/screenshots)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as Nats

from fleet.gateway.keys import add_key
from fleet.wire import subjects
from fleet.wire.cluster import NodeInfo
from fleet.wire.codec import encode
from tests.commands.test_exits import Command, free_port
from tests.dashboard.browser import browser, screenshot, wait
from tests.dashboard.test_dashboard_feed import accepted, finished, token
from tests.integration.harness import WorkerProcess, seed_models

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
    keys = root / "keys.jsonl"
    operator, tenant = add_key(keys, "ops", operator=True), add_key(keys, "team-a")
    up = Command(root, "up", "--models", "tiny-llm,tiny-flux2", "--port", str(http_port),
                 "--nats-port", str(nats_port), FLEET_API_KEYS_FILE=str(keys))
    try:
        up.wait_for_line("fleet up: NATS", timeout=180)
        yield {"base": f"http://127.0.0.1:{http_port}", "key": operator, "tenant_key": tenant,
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


@pytest.fixture(autouse=True)
def signed_in(request: pytest.FixtureRequest) -> None:
    """Every test but the one of the key prompt starts with the stack's key stored, whatever
    ran before it on the module's browser (alone, a test found the key prompt instead)."""
    if "page" not in request.fixturenames:
        return
    stack, page = request.getfixturevalue("stack"), request.getfixturevalue("page")
    if request.node.get_closest_marker("no_key"):
        go(page, stack, "fleet")
        page.execute_script("localStorage.removeItem('fleet.apiKey')")
        return
    use_key(page, stack, stack["key"], "fleet")


def text(driver: Any) -> str:
    return str(driver.find_element("tag name", "body").text)


def css(driver: Any, selector: str) -> list[Any]:
    return list(driver.find_elements("css selector", selector))


def go(driver: Any, stack: dict[str, Any], where: str) -> None:
    driver.get(f"{stack['base']}/ui#/{where}")


@pytest.mark.no_key
def test_without_a_key_the_page_asks_for_one_then_shows_the_fleet(
    page: Any, stack: dict[str, Any]
) -> None:
    go(page, stack, "fleet")
    dialog = wait(page, lambda d: (css(d, "#key-dialog[open]") or [None])[0], 20, "key prompt")
    assert "API key needed" in dialog.text
    screenshot(page, "dashboard-key")
    page.find_element("id", "key-input").send_keys(stack["key"])
    page.find_element("css selector", "#key-form button").click()
    wait(page, lambda d: css(d, "#nodes .node"), 30, "a node")
    wait(page, lambda d: css(d, '.runner[data-state="ready"] .states li.lit'), 120,
         "a ready runner with its state lit")
    lit = set(page.execute_script(  # one read: a fleet update redraws the cards
        "return [...document.querySelectorAll('.runner .states li.lit')].map(e => e.textContent)"))
    assert "ready" in lit, lit
    assert css(page, '.runner[data-state="ready"]')
    screenshot(page, "dashboard-fleet")


def test_model_pickers_default_to_a_ready_model_and_mark_the_unavailable_ones(
    page: Any, stack: dict[str, Any]
) -> None:
    use_key(page, stack, stack["key"], "fleet")
    wait(page, lambda d: len(css(d, '.runner[data-state="ready"]')) == 2, 120,
         "both runners ready")
    rates = wait(page, lambda d: [e.text for e in css(d, "#nodes .rate") if "tok/s" in e.text],
                 20, "the node's token rate")
    assert rates and all(r.endswith(" tok/s") for r in rates), rates
    # The texts in one read of the page: the live feed redraws the cards (a card held across
    # a redraw is stale).
    cards = page.execute_script(
        "return [...document.querySelectorAll('.instance .placement')].map(e => e.innerText)")
    assert cards and all("rank 0/1" not in c and " on " in c for c in cards), cards
    # an unsharded instance names its node, not "shards: rank 0/1"
    for where, picker in (("fleet", "place-model"), ("playground", "pg-model")):
        go(page, stack, where)
        page.refresh()  # the model list is read when the page opens
        wait(page, lambda d, p=picker: css(d, f"#{p} option"), 20, "the models")
        chosen = page.execute_script(f"return document.getElementById('{picker}').value")
        marks = {value: (ready, available, text) for value, ready, available, text in
                 page.execute_script(  # one read: the options may be redrawn meanwhile
                     f"return [...document.querySelectorAll('#{picker} option')].map(o => "
                     "[o.value, o.dataset.ready, o.dataset.available, o.innerText])")}
        assert chosen in ("tiny-llm", "tiny-flux2") and marks[chosen][0] == "true", marks
        unavailable = [m for m, (_, available, _) in marks.items() if available == "false"]
        assert "flux1-dev" in unavailable, marks  # 33.7 GB on no disk: marked, not the default
        assert all(marks[m][2].endswith("unavailable") for m in unavailable), marks


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
    wait(page, lambda d: css(d, '#task-trace .span-row'), 30, "the trace waterfall")
    # Each in one read of the page: the task page redraws its tables while spans arrive (a
    # row held across a redraw is stale; a hog run saw it).
    kinds = page.execute_script(
        "return [...document.querySelectorAll('tr[data-event]')].map(r => r.dataset.event)")
    # The tokens are one row that sums them up, between the acceptance and the end.
    assert kinds.count("tokens") == 1 and "token" not in kinds, kinds
    assert kinds.index("task_accepted") < kinds.index("tokens") < kinds.index("task_finished")
    services = set(page.execute_script(
        "return [...document.querySelectorAll('#task-trace .span-row')]"
        ".map(r => r.getAttribute('data-service'))"))
    assert any("runner" in (s or "") for s in services), services
    assert task_id in text(page)
    screenshot(page, "dashboard-task")
    go(page, stack, "tasks")
    wait(page, lambda d: css(d, f'tr[data-task="{task_id}"]'), 20, "the task in the list")
    screenshot(page, "dashboard-tasks")
    go(page, stack, "queues")
    wait(page, lambda d: css(d, 'tr[data-model="tiny-llm"]'), 20, "tiny-llm's queue")
    screenshot(page, "dashboard-queues")


async def continued(url: str, task_id: str) -> None:
    """A task continued once, stored as its workers would have stored it: attempt 0 on
    seam-a streamed tokens 0-2 and died; attempt 1 went on from token 3 on seam-b."""
    nc = Nats()
    await nc.connect(url)
    try:
        js = nc.jetstream()
        first = accepted(task_id).model_copy(update={"node_id": "seam-a", "runner_id": "ra"})
        second = accepted(task_id, at=2.5).model_copy(update={
            "node_id": "seam-b", "runner_id": "rb", "attempt": 1, "continued_from": 3,
            "moved_from": "seam-a", "delivery": 2})
        events = [first, *(token(task_id, i) for i in range(3)), second,
                  *(token(task_id, i) for i in range(3, 5)), finished(task_id)]
        for event in events:  # stored before the page asks (the page reads FLEET_OUT)
            await js.publish(subjects.out(task_id), encode(event))
    finally:
        await nc.close()


def test_a_continued_tasks_page_lists_its_attempts_with_the_seam(
    page: Any, stack: dict[str, Any]
) -> None:
    task_id = f"seam-{time.time_ns()}"
    asyncio.run(continued(stack["nats"], task_id))
    use_key(page, stack, stack["key"], f"task/{task_id}")  # the operator's (runs alone too)
    wait(page, lambda d: css(d, 'tr[data-event="task_finished"]'), 30, "the task's end")
    rows = wait(page, lambda d: css(d, "#task-attempts tr[data-attempt]"), 10, "the attempts")
    cells = [[td.text for td in row.find_elements("tag name", "td")] for row in rows]
    assert cells == [["0", "0", "–", "seam-a ra"], ["1", "3", "seam-a", "seam-b rb"]], cells
    assert page.find_element("id", "task-text").text == "a" * 5  # no gap, no duplicate
    screenshot(page, "dashboard-task-attempts")


def test_a_single_attempt_draws_no_attempts_table(page: Any, stack: dict[str, Any]) -> None:
    task_id = f"once-{time.time_ns()}"
    asyncio.run(crowd_one(stack["nats"], task_id))
    use_key(page, stack, stack["key"], f"task/{task_id}")
    wait(page, lambda d: css(d, 'tr[data-event="task_finished"]'), 30, "the task's end")
    assert not page.find_element("id", "task-attempts").is_displayed()


async def crowd_one(url: str, task_id: str) -> None:
    nc = Nats()
    await nc.connect(url)
    try:
        for event in (accepted(task_id), token(task_id), finished(task_id)):
            await nc.jetstream().publish(subjects.out(task_id), encode(event))
    finally:
        await nc.close()


def test_a_playground_conversation_sends_its_turns_system_prompt_and_sampling(
    page: Any, stack: dict[str, Any]
) -> None:
    use_key(page, stack, stack["key"], "playground")
    wait(page, lambda d: (css(d, '#pg-model option[value="tiny-llm"]') or [None])[0], 20,
         "the model list").click()
    page.execute_script(  # note each request body the page sends
        "window.sent = []; const send = window.fetch; window.fetch = (url, options) => {"
        " if (String(url).includes('/v1/chat/')) window.sent.push(JSON.parse(options.body));"
        " return send(url, options); };")
    for field, value in (("pg-system", "Be brief."), ("pg-temperature", "0"),
                         ("pg-max-tokens", "5")):
        element = page.find_element("id", field)
        element.clear()
        element.send_keys(value)
    answers = []
    for asked in ("first question", "second question"):
        prompt = page.find_element("id", "pg-prompt")
        prompt.clear()
        prompt.send_keys(asked)
        page.find_element("id", "pg-send").click()
        wait(page, lambda d: d.find_element("id", "pg-note").text == "done", 60, "the answer")
        answers.append(page.find_element("id", "pg-answer").text)
    sent = page.execute_script("return window.sent")
    assert [m["role"] for m in sent[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert sent[1]["messages"][0]["content"] == "Be brief."
    assert sent[1]["messages"][2]["content"].strip() == answers[0].strip()
    assert (sent[1]["temperature"], sent[1]["max_tokens"]) == (0, 5)
    roles = [t.get_attribute("data-role") for t in css(page, "#pg-history .turn")]
    assert roles == ["user", "assistant", "user"]  # the second answer is the one streaming
    screenshot(page, "dashboard-playground-chat")
    page.find_element("id", "pg-new").click()
    assert not css(page, "#pg-history .turn")


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
    instance_id = wait(page, lambda d: d.execute_script(
        "return [...document.querySelectorAll('.instance')].filter(c => "
        "c.textContent.includes('tiny-flux2')).map(c => c.dataset.instance)[0]"),
        30, "the image instance")
    page.find_element("css selector",
                      f'[data-instance="{instance_id}"] button.danger').click()
    page.switch_to.alert.accept()
    wait(page, lambda d: not css(d, f'[data-instance="{instance_id}"]'), 30,
         "the instance gone")
    screenshot(page, "dashboard-fleet-removed")


def listed_tasks(driver: Any) -> list[str]:
    """The task ids in the table, read in one script (the table is redrawn as rows change)."""
    return list(driver.execute_script(
        "return [...document.querySelectorAll('tr[data-task]')].map(r => r.dataset.task)"))


def use_key(driver: Any, stack: dict[str, Any], key: str, where: str) -> None:
    go(driver, stack, where)
    driver.execute_script("localStorage.setItem('fleet.apiKey', arguments[0])", key)
    driver.refresh()


def chat(driver: Any, stack: dict[str, Any]) -> str:
    """A chat from the playground; its task id."""
    go(driver, stack, "playground")
    wait(driver, lambda d: (css(d, '#pg-model option[value="tiny-llm"]') or [None])[0], 20,
         "the model list").click()
    driver.find_element("id", "pg-send").click()
    link = wait(driver, lambda d: (css(d, "#pg-task-link") or [None])[0], 60, "the task link")
    wait(driver, lambda d: d.find_element("id", "pg-note").text == "done", 60, "the answer")
    return str(link.text)


def test_a_tenant_key_sees_only_its_own_tasks_and_no_fleet_actions(
    page: Any, stack: dict[str, Any]
) -> None:
    try:
        use_key(page, stack, stack["tenant_key"], "playground")
        task_id = chat(page, stack)
        go(page, stack, "tasks")
        wait(page, lambda d: css(d, f'tr[data-task="{task_id}"]'), 20, "the tenant's task")
        assert set(listed_tasks(page)) == {task_id}  # not the operator's chat and image
        go(page, stack, "fleet")
        wait(page, lambda d: css(d, ".instance"), 20, "an instance")
        assert not page.execute_script(  # drawn hidden (offsetParent is null when hidden)
            "return [...document.querySelectorAll('.instance button.danger')]"
            ".some(b => b.offsetParent !== null)")
        assert not page.find_element("css selector", "form.operator-only").is_displayed()
        screenshot(page, "dashboard-tenant")
    finally:
        use_key(page, stack, stack["key"], "fleet")


async def crowd(url: str, nodes: int, tasks: int) -> list[str]:
    """Heartbeats of `nodes` stand-in nodes (too small to place on) and `tasks` finished
    tasks, as workers would publish them; the stand-in node ids."""
    nc = Nats()
    await nc.connect(url)
    try:
        kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
        now = time.time()
        ids = [f"crowd-{n:02}" for n in range(nodes)]
        for node_id in ids:
            info = NodeInfo(node_id=node_id, hostname=f"host-{node_id}", memory_total_bytes=1,
                            memory_available_bytes=0, cpu_count=1, started_at=now, at=now)
            await kv.put(node_id, encode(info))
        for n in range(tasks):
            task_id = f"crowd-task-{n:04}"
            await nc.publish(subjects.out(task_id), encode(accepted(task_id)))
            await nc.publish(subjects.out(task_id), encode(finished(task_id)))
        await nc.flush()
        return ids
    finally:
        await nc.close()


async def uncrowd(url: str, ids: list[str]) -> None:
    nc = Nats()
    await nc.connect(url)
    try:
        kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
        for node_id in ids:
            await kv.delete(node_id)
    finally:
        await nc.close()


BOUNDED_WAIT_S = 20.0  # generous: the box is shared; the number measured is printed


def test_fifty_nodes_and_a_thousand_tasks_are_drawn_within_a_bounded_wait(
    page: Any, stack: dict[str, Any]
) -> None:
    go(page, stack, "fleet")
    wait(page, lambda d: css(d, "#nodes .node"), 30, "the fleet")
    started = time.monotonic()
    ids = asyncio.run(crowd(stack["nats"], 50, 1000))
    try:
        wait(page, lambda d: len(css(d, "#nodes .node")) >= 51, BOUNDED_WAIT_S, "50 more nodes")
        print(f"51 nodes drawn {time.monotonic() - started:.1f} s after the first heartbeat")
        screenshot(page, "dashboard-fleet-50-nodes")
        go(page, stack, "tasks")
        count = wait(page, lambda d: [t for t in d.execute_script(
            "return [...document.querySelectorAll('#view p[role=status]')].map(e => e.textContent)")
            if t.endswith("of 1000 recent tasks")], BOUNDED_WAIT_S, "1,000 recent tasks")[0]
        print(f"tasks page: {count!r}, {time.monotonic() - started:.1f} s after publishing")
        assert len(listed_tasks(page)) == 200  # drawn at most 200 at a time
    finally:
        asyncio.run(uncrowd(stack["nats"], ids))


def test_a_batch_job_and_its_progress_are_on_the_queues_page(
    page: Any, stack: dict[str, Any]
) -> None:
    import json

    import httpx

    auth = {"Authorization": f"Bearer {stack['key']}"}
    lines = "".join(json.dumps({
        "custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny-llm", "max_tokens": 2,
                 "messages": [{"role": "user", "content": "hi"}]}}) + "\n" for i in range(3))
    upload = httpx.post(f"{stack['base']}/v1/files", headers=auth, data={"purpose": "batch"},
                        files={"file": ("b.jsonl", lines.encode())}, timeout=30).json()
    batch = httpx.post(f"{stack['base']}/v1/batches", headers=auth, timeout=30, json={
        "input_file_id": upload["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()
    go(page, stack, "queues")
    page.execute_script("localStorage.setItem('fleet.apiKey', arguments[0])", stack["key"])
    page.refresh()
    row = f'tr[data-batch="{batch["id"]}"]'
    wait(page, lambda d: [r for r in css(d, row) if "completed" in r.text and "3 / 3" in r.text],
         60, "the batch job completed on the queues page")
    screenshot(page, "dashboard-queues-batch")

"""The Playground's image attachment in a real browser against a real `fleet up` with
tiny-vlm (no keys file: no key prompt): a PNG chosen in the file input goes with the next turn
as a data-URL image part, shows in the conversation, stays in the turns sent after it, and
the answer streams (the image's 16 placeholder tokens reach the model: usage says so)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from tests.commands.test_exits import Command, free_port
from tests.dashboard.browser import browser, screenshot, wait
from tests.integration.harness import seed_models

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tiny_vlm_dir: Path) -> Iterator[str]:
    root = tmp_path_factory.mktemp("vision-playground")
    seed_models(root / "data", {"tiny-vlm": tiny_vlm_dir})
    http_port, nats_port = free_port(), free_port()
    up = Command(root, "up", "--models", "tiny-vlm", "--port", str(http_port),
                 "--nats-port", str(nats_port))
    try:
        up.wait_for_line("fleet up: NATS", timeout=180)
        yield f"http://127.0.0.1:{http_port}"
    finally:
        up.kill()


def test_an_attached_image_goes_with_its_turn_and_stays_in_the_chat(
    base: str, tmp_path: Path
) -> None:
    picture = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (220, 20, 20)).save(picture)
    page = browser()
    try:
        page.get(f"{base}/ui#/playground")
        wait(page, lambda d: (d.find_elements("css selector", '#pg-model option[value="tiny-vlm"]')
                              or [None])[0], 60, "tiny-vlm in the model list").click()
        page.execute_script(  # note each request body the page sends
            "window.sent = []; const send = window.fetch; window.fetch = (url, options) => {"
            " if (String(url).includes('/v1/chat/')) window.sent.push(JSON.parse(options.body));"
            " return send(url, options); };")
        for field, value in (("pg-temperature", "0"), ("pg-max-tokens", "4")):
            element = page.find_element("id", field)
            element.clear()
            element.send_keys(value)
        page.find_element("id", "pg-attach").send_keys(str(picture))
        wait(page, lambda d: d.find_elements("css selector", "#pg-attached img"), 10,
             "the attached image's thumbnail")
        for asked in ("What is in this picture?", "And its colour?"):
            prompt = page.find_element("id", "pg-prompt")
            prompt.clear()
            prompt.send_keys(asked)
            page.find_element("id", "pg-send").click()
            wait(page, lambda d: d.find_element("id", "pg-note").text == "done", 120,
                 "the answer")
        sent = page.execute_script("return window.sent")
        first = sent[0]["messages"][-1]["content"]
        assert [part["type"] for part in first] == ["image_url", "text"]
        assert first[0]["image_url"]["url"].startswith("data:image/png;base64,")
        assert sent[1]["messages"][0]["content"] == first  # the image stays in the chat
        assert sent[1]["messages"][-1]["content"] == "And its colour?"  # detached after use
        assert page.find_elements("css selector", "#pg-history .turn.user img.attached")
        assert not page.find_elements("css selector", "#pg-attached img")
        screenshot(page, "dashboard-playground-vision")
    finally:
        page.quit()

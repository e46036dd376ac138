"""Vision chat with the official `openai` client against real processes: nats-server,
`fleet worker` running tiny-vlm in a vision runner, and `fleet gateway`. One stack for the
module. The image goes into FLEET_IMAGES at the gateway, the task carries its sha256, the node
fetches it before dispatch; images over the limits or unreadable are refused with a 400."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from load_helpers import one_model_stack
from PIL import Image

from fleet.gateway.vision import MAX_CHAT_IMAGES

# the anthropic, ollama and openai clients are imported where used, not at the top:
# collection imports this module in every xdist worker (anthropic costs 1.9 s of CPU, openai
# 0.7 s; issue 28).
if TYPE_CHECKING:
    import anthropic
    import ollama
    import openai

MODEL = "tiny-vlm"
IMAGE_TOKENS = 16  # tiny-vlm: 32x32 pixels in 8x8 patches


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, tiny_vlm_dir: Path) -> Iterator[str]:
    """The gateway's base URL. Its image URLs may point at loopback (the test's server)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FLEET_IMAGE_FETCH", "private")
        with one_model_stack(tmp_path_factory.mktemp("vision"), MODEL, tiny_vlm_dir,
                             slots=4) as (_, url):
            yield url


@pytest.fixture(scope="module")
def sdk(url: str) -> openai.OpenAI:
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)


def png_b64(size: tuple[int, int], colour: tuple[int, int, int] = (200, 30, 30)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def png_url(size: tuple[int, int]) -> str:
    return "data:image/png;base64," + png_b64(size)


def ask(sdk: openai.OpenAI, *urls: str) -> openai.types.chat.ChatCompletion:
    content: list[dict[str, object]] = [
        {"type": "image_url", "image_url": {"url": url}} for url in urls
    ]
    content.append({"type": "text", "text": "What is in this picture?"})
    return sdk.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0.0,
        messages=[{"role": "user", "content": content}],  # type: ignore[list-item,misc]
    )


def test_a_chat_with_a_data_url_image_is_answered(sdk: openai.OpenAI) -> None:
    with_image = ask(sdk, png_url((40, 30)))
    without = ask(sdk)
    choice = with_image.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert with_image.usage and without.usage
    # The runner saw the image: its placeholders are in the prompt the model read.
    assert with_image.usage.prompt_tokens == without.usage.prompt_tokens + IMAGE_TOKENS


@pytest.mark.parametrize(("urls", "reason"), [
    (lambda: [png_url((4097, 4096))], "pixels, over the limit"),
    (lambda: ["data:image/png;base64,"
              + base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode()],
     "could not be read"),
    (lambda: ["data:image/png;base64,@@@"], "not valid base64"),
    (lambda: [png_url((8, 8))] * (MAX_CHAT_IMAGES + 1), f"at most {MAX_CHAT_IMAGES}"),
], ids=["too-many-pixels", "not-an-image", "not-base64", "too-many-images"])
def test_bad_images_get_a_400_with_the_reason(
    sdk: openai.OpenAI, urls: Callable[[], list[str]], reason: str
) -> None:
    import openai
    with pytest.raises(openai.BadRequestError) as refused:
        ask(sdk, *urls())  # made here: a 16-megapixel PNG is no work for collection
    assert refused.value.status_code == 400
    assert reason in str(refused.value.message)


def test_anthropic_image_blocks_reach_the_model_and_bad_ones_are_refused(url: str) -> None:
    import anthropic
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)

    def ask_claude(data: str | None) -> anthropic.types.Message:
        content: list[dict[str, object]] = [{"type": "text", "text": "What is this?"}]
        if data is not None:
            content.insert(0, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": data}})
        return claude.messages.create(model=MODEL, max_tokens=4,
                                      messages=[{"role": "user", "content": content}])  # type: ignore[typeddict-item,list-item,misc]

    seen, plain = ask_claude(png_b64((20, 20))), ask_claude(None)
    assert seen.usage.input_tokens == plain.usage.input_tokens + IMAGE_TOKENS
    with pytest.raises(anthropic.BadRequestError, match="pixels, over the limit"):
        ask_claude(png_b64((4097, 4096)))


def test_ollama_images_reach_the_model_and_bad_ones_are_refused(url: str) -> None:
    import ollama
    local = ollama.Client(host=url, timeout=60)

    def ask_ollama(images: list[str]) -> ollama.ChatResponse:
        return local.chat(model=MODEL, options={"num_predict": 4, "temperature": 0.0},
                          messages=[{"role": "user", "content": "What is this?",
                                     "images": images}])

    seen, plain = ask_ollama([png_b64((20, 20))]), ask_ollama([])
    assert seen.prompt_eval_count == (plain.prompt_eval_count or 0) + IMAGE_TOKENS
    with pytest.raises(ollama.ResponseError) as refused:
        ask_ollama([base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode()])
    assert refused.value.status_code == 400 and "could not be read" in refused.value.error


def test_the_same_image_twice_is_a_vision_cache_hit_with_the_same_answer(
    sdk: openai.OpenAI,
) -> None:
    image = "data:image/png;base64," + png_b64((24, 24), (12, 200, 90))  # new to this stack
    first, second = ask(sdk, image), ask(sdk, image)
    assert first.choices[0].message.content == second.choices[0].message.content
    details = [reply.usage.prompt_tokens_details for reply in (first, second)]  # type: ignore[union-attr]
    counts = [(d.model_extra or {}) if d else {} for d in details]
    assert [(c.get("images"), c.get("cached_images")) for c in counts] == [(1, 0), (1, 1)]


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A plain HTTP server on loopback with one PNG at /cat.png and a page at /page.html."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    cat = base64.b64decode(png_b64((30, 20), (90, 90, 200)))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, kind = (cat, "image/png") if self.path == "/cat.png" else (b"<p>hi</p>",
                                                                            "text/html")
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_http_image_url_is_fetched_by_the_gateway(
    sdk: openai.OpenAI, image_server: str
) -> None:
    import openai
    fetched, plain = ask(sdk, f"{image_server}/cat.png"), ask(sdk)
    assert fetched.usage and plain.usage
    assert fetched.usage.prompt_tokens == plain.usage.prompt_tokens + IMAGE_TOKENS
    with pytest.raises(openai.BadRequestError, match="not a PNG, JPEG or WebP image"):
        ask(sdk, f"{image_server}/page.html")
    with pytest.raises(openai.BadRequestError, match=r"must be an http\(s\) URL"):
        ask(sdk, "ftp://127.0.0.1/cat.png")


def test_a_responses_input_image_and_an_anthropic_url_image_reach_the_model(
    sdk: openai.OpenAI, url: str, image_server: str
) -> None:
    import anthropic
    def respond(*parts: dict[str, object]) -> int:
        reply = sdk.responses.create(model=MODEL, max_output_tokens=4, temperature=0.0,
                                     input=[{"role": "user", "content": [  # type: ignore[list-item,misc]
                                         *parts, {"type": "input_text", "text": "What is it?"}]}])
        assert reply.usage is not None
        return reply.usage.input_tokens

    plain = respond()
    assert respond({"type": "input_image", "image_url": png_url((16, 16))}) \
        == plain + IMAGE_TOKENS
    assert respond({"type": "input_image", "image_url": f"{image_server}/cat.png"}) \
        == plain + IMAGE_TOKENS
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    seen = claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [  # type: ignore[typeddict-item,list-item,misc]
        {"type": "image", "source": {"type": "url", "url": f"{image_server}/cat.png"}},
        {"type": "text", "text": "What is this?"}]}])
    assert seen.usage.input_tokens > IMAGE_TOKENS

"""http(s) image URLs fetched by the gateway: which URLs and addresses it may call (pure
tables), and fetches from a real HTTP server on loopback: an image comes back whole; too big,
slow, not an image, an error status, unreachable, a redirect to another scheme and too many
redirects are refused with the reason; the default policy refuses loopback."""

from __future__ import annotations

import io
import ipaddress
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from fleet.config import load_settings
from fleet.errors import InvalidSetting
from fleet.gateway.image_fetch import (
    FetchRefused,
    address_refusal,
    fetch_image,
    url_refusal,
)


def png(size: tuple[int, int] = (12, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (30, 60, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png()


@pytest.mark.parametrize(("url", "reason"), [
    ("https://example.com/cat.png", None),
    ("http://example.com:8080/a?b=c", None),
    ("ftp://example.com/cat.png", "only http and https"),
    ("file:///etc/passwd", "only http and https"),
    ("gopher://x/", "only http and https"),
    ("http:///cat.png", "names no host"),
    ("http://user:secret@example.com/cat.png", "carries credentials"),
])
def test_which_urls_are_fetched(url: str, reason: str | None) -> None:
    found = url_refusal(url)
    assert (found is None) if reason is None else (found is not None and reason in found)


@pytest.mark.parametrize(("address", "policy", "reason"), [
    ("93.184.216.34", "public", None),
    ("2606:2800:220:1::1", "public", None),
    ("127.0.0.1", "public", "private or loopback"),
    ("10.1.2.3", "public", "private or loopback"),
    ("192.168.1.5", "public", "private or loopback"),
    ("::1", "public", "private or loopback"),
    ("::ffff:127.0.0.1", "public", "private or loopback"),
    ("127.0.0.1", "private", None),
    ("10.1.2.3", "private", None),
    ("169.254.169.254", "private", "not an address"),  # cloud metadata: never
    ("169.254.169.254", "public", "not an address"),
    ("fe80::1", "private", "not an address"),
    ("0.0.0.0", "private", "not an address"),
    ("224.0.0.1", "private", "not an address"),
    ("93.184.216.34", "off", "off on this gateway"),
])
def test_which_addresses_may_be_called(address: str, policy: str, reason: str | None) -> None:
    found = address_refusal(ipaddress.ip_address(address), policy)
    assert (found is None) if reason is None else (found is not None and reason in found)


@pytest.mark.parametrize(("value", "policy"), [
    ({}, "public"), ({"FLEET_IMAGE_FETCH": "Private"}, "private"),
    ({"FLEET_IMAGE_FETCH": " off"}, "off"),
])
def test_the_policy_setting(value: dict[str, str], policy: str) -> None:
    assert load_settings(env=value).image_fetch == policy


def test_an_unknown_policy_stops_the_gateway_at_start() -> None:
    """Checked with the other settings, before the gateway serves: not a 400 per request."""
    with pytest.raises(InvalidSetting, match="FLEET_IMAGE_FETCH: 'everything'"):
        load_settings(env={"FLEET_IMAGE_FETCH": "everything"})


class Handler(BaseHTTPRequestHandler):
    release = threading.Event()  # the slow path waits on it; set at teardown

    def do_GET(self) -> None:
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
            "/page.html": (200, {"Content-Type": "text/html"}, b"<html>hello</html>"),
            "/missing.png": (404, {}, b"no"),
            "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
            "/to-cat": (301, {"Location": "/cat.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
        }
        if self.path == "/huge.png":
            self._send(200, {"Content-Length": str(9 * 1024**2)}, b"")
            self.wfile.write(PNG + b"\0" * 1024)
        elif self.path == "/chunked.png":  # no length: counted as it comes
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(9):
                block = b"\0" * 1024**2
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/slow.png":
            self.release.wait(30)
            self._send(200, {}, PNG)
        else:
            self._send(*routes.get(self.path, (404, {}, b"")))

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        Handler.release.set()
        httpd.shutdown()
        httpd.server_close()


async def test_an_image_url_is_fetched_whole(server: str) -> None:
    assert await fetch_image(f"{server}/cat.png", "private") == PNG
    assert await fetch_image(f"{server}/to-cat", "private") == PNG  # a redirect, followed


@pytest.mark.parametrize(("path", "reason"), [
    ("/huge.png", "over the limit"),
    ("/chunked.png", "the limit"),
    ("/page.html", "not a PNG, JPEG or WebP image (content-type text/html)"),
    ("/missing.png", "answered HTTP 404"),
    ("/to-file", "only http and https"),
    ("/loop", "more than 3 redirects"),
])
async def test_bad_image_urls_are_refused_with_the_reason(
    server: str, path: str, reason: str
) -> None:
    with pytest.raises(FetchRefused) as refused:
        await fetch_image(f"{server}{path}", "private")
    assert reason in str(refused.value)


async def test_a_slow_or_unreachable_server_is_refused(server: str) -> None:
    with pytest.raises(FetchRefused, match=r"did not answer in 0\.5 s"):
        await fetch_image(f"{server}/slow.png", "private", timeout_s=0.5)
    import socket

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(FetchRefused, match="could not be read"):
        await fetch_image(f"http://127.0.0.1:{port}/cat.png", "private")
    with pytest.raises(FetchRefused, match="could not be resolved"):
        await fetch_image("http://no-such-host.invalid/cat.png", "private")


async def test_the_default_policy_refuses_loopback(server: str) -> None:
    with pytest.raises(FetchRefused, match="private or loopback"):
        await fetch_image(f"{server}/cat.png", "public")
    with pytest.raises(FetchRefused, match="private or loopback"):
        await fetch_image(f"http://localhost:{server.rsplit(':', 1)[1]}/cat.png", "public")

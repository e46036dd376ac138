"""http(s) image URLs in a chat, fetched by the gateway before anything is stored.

The gateway reads each URL within limits (MAX_IMAGE_BYTES, FETCH_TIMEOUT_S for the whole
fetch, redirects included, at most MAX_REDIRECTS of them, each to http or https again) and
passes on its bytes exactly as if the client had sent them as a data URL: the same image
checks, the same store. Whatever goes wrong is a 400 that names the image and the reason.

Whom the gateway may be made to call (server-side request forgery) is a policy, the setting
`image_fetch` (`FLEET_IMAGE_FETCH`, `--image-fetch`; fleet/config.py checks it at start):
- `public` (the default): only global addresses. A client of the gateway cannot make it read
  the loopback (NATS monitoring, the dashboard), the LAN, or a cloud's metadata service.
- `private`: any unicast address but link-local ones (169.254.0.0/16, fe80::/10: the
  metadata services), for a fleet whose images sit on a LAN server or this machine.
- `off`: no URL is fetched; data URLs and stored images only.
Every address a name resolves to must pass, and the request goes to the address that was
checked (the name travels in Host and in TLS's SNI), so a name cannot resolve to a public
address for the check and a private one for the connection. Proxies from the environment are
not used.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
import ssl
from functools import cache
from urllib.parse import urljoin, urlsplit

import httpx

from fleet.errors import InvalidParameter
from fleet.gateway.bodies import image_format, stored_image
from fleet.gateway.vision import MAX_CHAT_IMAGES, MAX_IMAGE_BYTES

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
POLICIES = ("public", "private", "off")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@cache
def _tls() -> ssl.SSLContext:
    """One verifying context for every fetch: making one costs tens of ms on a busy CPU."""
    return ssl.create_default_context()


class FetchRefused(Exception):
    """Why an image URL was not read (the 400's reason)."""


def is_remote(url: str) -> bool:
    """An http(s) URL to fetch; a /v1/images/<sha256> URL names an image this fleet stores,
    read from the store under the tenant's rights, never fetched (a gateway may not resolve
    its own public name, and a fetch would bypass the owner check)."""
    return (url[:8].lower().startswith(("http://", "https://"))
            and stored_image(url) is None)


def url_refusal(url: str) -> str | None:
    """Why this URL is not fetched, judged on its text alone, or None. Pure."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"only http and https image URLs are fetched, not {parts.scheme or 'none'}:"
    if not parts.hostname:
        return "the image URL names no host"
    if parts.username is not None or parts.password is not None:
        return "the image URL carries credentials"
    return None


def address_refusal(address: Address, policy: str) -> str | None:
    """Why this resolved address may not be called under `policy`, or None. Pure."""
    if policy == "off":
        return "fetching image URLs is off on this gateway (FLEET_IMAGE_FETCH=off)"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_unspecified or address.is_multicast or address.is_link_local:
        return f"{address} is not an address images are fetched from"
    if policy == "public" and not address.is_global:
        return (f"{address} is a private or loopback address; this gateway fetches only "
                "from public ones (FLEET_IMAGE_FETCH=private allows them)")
    return None


async def fetch_chat_images(urls: list[str], policy: str, param: str = "messages") -> list[str]:
    """Each URL as the gateway's image checks take it: http(s) ones fetched (under `policy`,
    one of POLICIES) and turned into data URLs, the rest as they are. Raises
    InvalidParameter (400) naming the image."""
    remote = [(i, url) for i, url in enumerate(urls) if is_remote(url)]
    if not remote or len(urls) > MAX_CHAT_IMAGES:  # too many: refused unread by the checks
        return urls
    if policy == "off":
        raise InvalidParameter(f"image {remote[0][0]}: fetching image URLs is off on this "
                               "gateway (FLEET_IMAGE_FETCH=off)", param)

    async def one(index: int, url: str) -> tuple[int, str]:
        try:
            data = await fetch_image(url, policy)
        except FetchRefused as exc:
            raise InvalidParameter(f"image {index}: {exc}", param) from None
        kind = image_format(data)
        return index, f"data:image/{kind};base64," + base64.b64encode(data).decode()

    fetched = dict(await asyncio.gather(*(one(i, url) for i, url in remote)))
    return [fetched.get(index, url) for index, url in enumerate(urls)]


async def fetch_image(url: str, policy: str, timeout_s: float = FETCH_TIMEOUT_S,
                      max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The image at `url` (PNG, JPEG or WebP bytes), or FetchRefused with the reason."""
    try:
        async with asyncio.timeout(timeout_s), httpx.AsyncClient(
            follow_redirects=False, trust_env=False, timeout=timeout_s, verify=_tls(),
        ) as client:
            for _ in range(MAX_REDIRECTS + 1):
                location = await _get(client, url, policy, max_bytes)
                if isinstance(location, bytes):
                    return location
                url = urljoin(url, location)
            raise FetchRefused(f"more than {MAX_REDIRECTS} redirects")
    except TimeoutError:
        raise FetchRefused(f"the image URL did not answer in {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise FetchRefused(f"the image URL could not be read ({type(exc).__name__}: "
                           f"{exc or 'no detail'})") from None


async def _get(client: httpx.AsyncClient, url: str, policy: str, max_bytes: int) -> bytes | str:
    """The body of a 200, or the Location of a redirect."""
    if why := url_refusal(url):
        raise FetchRefused(why)
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = await _checked_address(host, port, policy)
    target = httpx.URL(url).copy_with(host=str(address))
    async with client.stream("GET", target, headers={"Host": parts.netloc},
                             extensions={"sni_hostname": host}) as response:
        if response.is_redirect and (location := response.headers.get("location")):
            return location
        if response.status_code != 200:
            raise FetchRefused(f"the image URL answered HTTP {response.status_code}")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise FetchRefused(f"{declared} bytes, over the limit of {max_bytes}")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise FetchRefused(f"over {max_bytes} bytes, the limit")
    if image_format(bytes(body[:16])) is None:
        kind = response.headers.get("content-type", "unknown")
        raise FetchRefused(f"not a PNG, JPEG or WebP image (content-type {kind})")
    return bytes(body)


async def _checked_address(host: str, port: int, policy: str) -> Address:
    """The address to call: every one the name resolves to must pass the policy."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise FetchRefused(f"the image URL's host {host} could not be resolved ({exc})") \
            from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise FetchRefused(f"the image URL's host {host} has no address")
    for address in addresses:
        if why := address_refusal(address, policy):
            raise FetchRefused(why)
    return addresses[0]

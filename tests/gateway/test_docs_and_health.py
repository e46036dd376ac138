"""/health answers as /healthz does; /docs is Swagger UI over /openapi.json, served from the
gateway itself (no CDN), open without an API key like the document it shows; / is a page
that links the dashboard, the docs and the models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
from starlette.applications import Starlette

from fleet.commands.gateway import build_app
from fleet.config import Settings


async def test_health_is_healthz_by_another_name(client: httpx.AsyncClient) -> None:
    health, healthz = await client.get("/health"), await client.get("/healthz")
    assert health.status_code == healthz.status_code == 200
    assert health.json()["status"] == healthz.json()["status"] == "ok"
    assert health.json().keys() == healthz.json().keys()


async def test_docs_is_swagger_ui_over_the_openapi_document_with_no_cdn(
    client: httpx.AsyncClient,
) -> None:
    page = await client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '"/openapi.json"' in page.text
    assert "https://" not in page.text and "http://" not in page.text  # offline-safe
    for asset in ("swagger-ui-bundle.js", "swagger-ui-standalone-preset.js", "swagger-ui.css"):
        assert f"/docs/static/{asset}" in page.text
        served = await client.get(f"/docs/static/{asset}")
        assert served.status_code == 200 and len(served.content) > 10_000, asset
    assert (await client.get("/docs/static/no-such-file.js")).status_code == 404


async def test_the_root_is_a_page_that_links_where_to_go(client: httpx.AsyncClient) -> None:
    page = await client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for link in ('href="/ui"', 'href="/docs"', 'href="/v1/models"'):
        assert link in page.text
    assert "http://gateway/v1" in page.text  # the base URL a client configures
    for target in ("/ui", "/docs", "/v1/models"):  # every link leads somewhere
        assert (await client.get(target)).status_code == 200, target


async def keyed(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app: Starlette = build_app(replace(settings, api_keys=("secret-key",)))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            yield http


async def test_with_keys_the_docs_and_health_stay_open_and_the_api_does_not(
    settings: Settings, nc: object,
) -> None:
    async for http in keyed(settings):
        assert (await http.get("/docs")).status_code == 200
        assert (await http.get("/docs/static/swagger-ui-bundle.js")).status_code == 200
        assert (await http.get("/openapi.json")).status_code == 200
        assert (await http.get("/")).status_code == 200
        health = await http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}  # no details
        assert (await http.get("/v1/models")).status_code == 401

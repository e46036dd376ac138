"""GET /docs: Swagger UI over this gateway's /openapi.json. Its files come from the
swagger-ui-bundle-v2 package (Swagger UI 5, which reads OpenAPI 3.1), never from a CDN: a
gateway may run where nothing outside can be reached. Open like /openapi.json: the page holds
no data, and its "Authorize" button sends an API key to the routes that need one."""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse

from fleet.gateway.route_table import Row

log = logging.getLogger(__name__)

PAGE = "/docs"
ASSETS = "/docs/static"

_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Fleet gateway API</title>
<link rel="stylesheet" href="{assets}/swagger-ui.css">
<link rel="icon" type="image/png" href="{assets}/favicon-32x32.png" sizes="32x32">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{assets}/swagger-ui-bundle.js"></script>
<script src="{assets}/swagger-ui-standalone-preset.js"></script>
<script>
window.ui = SwaggerUIBundle({{
  url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
  layout: "StandaloneLayout",
}});
</script>
</body>
</html>
"""


def is_open(path: str) -> bool:
    """The page and its files need no API key."""
    return path == PAGE or path.startswith(ASSETS + "/")


async def page(request: Request) -> HTMLResponse:
    return HTMLResponse(_HTML.format(assets=ASSETS))


def rows() -> tuple[Row, ...]:
    """/docs and its files; none when the package is missing (an install without it), which is
    logged: the API itself does not need the page."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        log.warning("no /docs: the package swagger-ui-bundle-v2 is not installed "
                    "(the OpenAPI document is still at /openapi.json)")
        return ()
    return (Row("GET", PAGE, page, summary="This document in Swagger UI (served by the gateway:"
                " no CDN)", operation_id="docs", ok="An HTML page",
                content={"text/html": {"type": "string"}}, errors=("400", "401")),
            Row("GET", ASSETS, static=Path(str(swagger_ui_path)), public=False))

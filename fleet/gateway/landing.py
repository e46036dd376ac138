"""GET /: a small page that says what this server is and links where to go (the dashboard,
the API docs, the models), instead of a JSON 404. Open like /docs: it holds no data."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse

from fleet.gateway.route_table import Row

PAGE = "/"

_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Fleet gateway</title>
<style>
body {{ font: 16px/1.5 system-ui, sans-serif; max-width: 40rem; margin: 3rem auto;
       padding: 0 1rem; }}
code {{ background: #f2f2f2; padding: 0.1rem 0.3rem; }}
</style>
</head>
<body>
<h1>Fleet gateway</h1>
<p>An OpenAI-compatible API over a fleet of model workers. Its base URL is
<code>{base}/v1</code>.</p>
<ul>
<li><a href="/ui">Dashboard</a>: nodes, runners, queues, tasks, a playground</li>
<li><a href="/docs">API docs</a>: every route, with Try it out
(<a href="/openapi.json">OpenAPI document</a>)</li>
<li><a href="/v1/models">Models</a> usable now
(<a href="/v1/models?all=true">every model card</a>)</li>
<li><a href="/healthz">Health</a></li>
</ul>
<p>With API keys configured, the API and the dashboard ask for one:
<code>Authorization: Bearer KEY</code>.</p>
</body>
</html>
"""


async def page(request: Request) -> HTMLResponse:
    base = str(request.base_url).rstrip("/")
    return HTMLResponse(_HTML.format(base=base))


def rows() -> tuple[Row, ...]:
    """A page, not an API: served, and left out of the OpenAPI document."""
    return (Row("GET", PAGE, page, public=False),)

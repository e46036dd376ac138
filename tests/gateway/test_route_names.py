"""HTTP spans and metrics are named by route template (gateway/observability.py route_of)."""

from __future__ import annotations

import pytest

from fleet.commands.gateway import build_app
from fleet.config import Settings
from fleet.gateway.observability import UNTRACED_URLS, route_of

ROUTES = build_app(Settings(nats_url="nats://127.0.0.1:1")).router.routes
HASH = "ab" * 32


@pytest.mark.parametrize(
    ("method", "path", "template"),
    [
        ("POST", "/v1/chat/completions", "/v1/chat/completions"),
        ("GET", "/v1/tasks/chat-x1/events", "/v1/tasks/{task_id}/events"),
        ("GET", f"/v1/images/{HASH}", "/v1/images/{sha256}"),
        ("GET", "/v1/models/org/model", "/v1/models/{model}"),
        ("DELETE", "/v1/chat/completions", "/v1/chat/completions"),  # the router's 405
        ("GET", "/ui/api/tasks/chat-x1/trace", "/ui/api/tasks/{task_id}/trace"),  # the dashboard
        ("GET", "/nowhere", None),
    ],
)
def test_route_of(method: str, path: str, template: str | None) -> None:
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    assert route_of(ROUTES, scope) == template


@pytest.mark.parametrize(
    ("url", "untraced"),
    [
        ("http://gw:8000/healthz", True),
        ("http://gw:8000/metrics", True),
        ("https://gw/ui/static/app.js", True),
        ("http://gw:8000/v1/models/metrics", False),  # a model may be called that
        ("http://gw:8000/metrics/x", False),
        ("http://gw:8000/ui", False),
    ],
)
def test_untraced_urls(url: str, untraced: bool) -> None:
    assert UNTRACED_URLS.url_disabled(url) is untraced

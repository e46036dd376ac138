"""Every error answer under /api/ in Ollama's shape, `{"error": "..."}`: the routes' own, the
relay's (a task that failed after it was published), and those made before a route runs (a
missing key, a body too large or too slow, an unknown /api/ path), whatever made them. The
status and headers (x-fleet-task-id, retry-after) stay; only the body changes. Answers that
are not errors stream through untouched; an error answer is small and whole, so it is held
until its end."""

from __future__ import annotations

from http import HTTPStatus

import orjson

PATH = "/api/"


def ollama_error_body(status: int, body: bytes) -> bytes:
    """The body of an error answer in Ollama's shape (pure): OpenAI's `error.message`, an
    Ollama-shaped body as it is, and words for the status when the body has none."""
    try:
        found = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        found = None
    error = found.get("error") if isinstance(found, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        error = error["message"]
    if not isinstance(error, str) or not error:
        try:
            error = HTTPStatus(status).phrase.lower()
        except ValueError:
            error = f"error {status}"
    return orjson.dumps({"error": error})

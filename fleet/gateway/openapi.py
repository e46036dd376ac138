"""The OpenAPI 3.1 document of the gateway, made from its route table (fleet.gateway.api_table)
and the same pydantic models that parse the requests, so the document cannot drift from what
the routes serve or accept. Here: the parts no row owns (the OpenAI error body, the edit
form's schema, the document's frame)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from fleet.gateway.route_table import Errors, Row, Schema, paths_and_schemas


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


OPENAI_ERRORS = Errors(model=ErrorBody, described={
    "400": "Invalid request",
    "401": "Missing or wrong API key (when keys are configured)",
    "404": "Unknown model, image or route; a task with no stored events; another API key's "
    "task or image (the same answer, so nothing confirms it exists)",
    "408": "The request body did not arrive in time (FLEET_GATEWAY_BODY_TIMEOUT_S)",
    "413": "Request body too large, or a task larger than a NATS message may be",
    "429": "The model's queue is full, or too many requests are waiting (per key or in all); "
    "see Retry-After",
    "502": "A stored image does not hash to its name: refused, not served",
    "503": "NATS unreachable",
    "504": "No terminal event before the deadline",
})


def _form_field(schema: dict[str, Any]) -> dict[str, Any]:
    """A form has no null: an optional field is left out, so drop the null alternative."""
    alternatives = [a for a in schema.get("anyOf", []) if a.get("type") != "null"]
    if len(alternatives) != 1:
        return schema
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    return {**rest, **alternatives[0]}


def edit_form_schema(base: Schema) -> Schema:
    """POST /v1/images/edits: ImageEditRequest's fields as form fields, and 1 to 8 images."""
    binary = {"type": "string", "format": "binary"}
    files = {"type": "array", "items": binary, "minItems": 1, "maxItems": 8}
    fields = {name: _form_field(field) for name, field in base["properties"].items()}
    return {
        **base,
        "properties": {"image": files, **fields},
        "required": ["image", *base.get("required", [])],
    }


def document(rows: Iterable[Row], extra: Iterable[type[BaseModel]] = ()) -> dict[str, Any]:
    """The document of a route table's public rows (`extra`: models to list in the
    components though no row names them)."""
    paths, schemas = paths_and_schemas(rows, OPENAI_ERRORS, (ErrorBody, *extra))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Fleet gateway",
            "version": "1",
            "description": "An OpenAI-compatible API over Fleet's NATS task subjects.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"x_api_key": []}, {}],
    }

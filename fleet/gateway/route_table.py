"""The HTTP surface as data: one `Row` per operation (method, path, handler and what the OpenAPI
document says of it), declared once, from which both the Starlette routes (`routes`) and the
document's `paths` and `components.schemas` (`paths_and_schemas`) are made. The gateway's table
is fleet.gateway.api_table; the dashboard declares its /ui rows with the same type (through
fleet.gateway.surface). A route cannot be served without being described, nor described
without being served: tests/gateway/test_route_table.py holds both sides to the table."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route, compile_path
from starlette.staticfiles import StaticFiles

Endpoint = Callable[[Request], Awaitable[Response]]
Schema = Mapping[str, Any]

REF = "#/components/schemas/{model}"
# The ids of tasks, files and batches: what the handlers accept (anything else is unknown).
ID_PATTERN = "^[A-Za-z0-9_-]{1,128}$"


# Registered with Starlette here, before any table's path is compiled.
class Sha256Convertor(Convertor[str]):
    """Only a hash names an image, so GET /v1/images/edits is a 405, not a bad image name."""

    regex = "[0-9a-f]{64}"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("sha256", Sha256Convertor())


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


@dataclass(frozen=True)
class Param:
    """A query or header parameter (path parameters come from the row's path)."""

    name: str
    where: Literal["query", "header"]
    schema: Schema
    description: str = ""
    required: bool = False


@dataclass(frozen=True)
class Body:
    """A request body: JSON validated by `model`, or a form whose schema `form` makes from the
    model's JSON Schema (or, with no model, gives as it is)."""

    model: type[BaseModel] | None = None
    media_type: str = "application/json"
    form: Callable[[Schema], Schema] | Schema | None = None


@dataclass(frozen=True)
class Stream:
    """What a route that can stream sends instead of one JSON answer: its media type and the
    schema of one event (an SSE frame, an NDJSON line)."""

    media_type: str
    event: type[BaseModel] | Schema


@dataclass(frozen=True)
class Errors:
    """How a family of routes answers an error: the body (a model, or a schema) and what each
    status means there."""

    described: Mapping[str, str]
    model: type[BaseModel] | None = None
    schema: Schema | None = None

    def content(self) -> dict[str, Any]:
        schema = ref(self.model) if self.model else dict(self.schema or {"type": "object"})
        return {"application/json": {"schema": schema}}


JSON_OBJECT: Schema = {"type": "object"}
# One server-sent event; `data` is JSON (or `[DONE]` at the end of a chat stream).
SSE = Stream("text/event-stream", {
    "type": "object",
    "properties": {"event": {"type": "string"}, "id": {"type": "string"},
                   "data": {"type": "string"}},
    "required": ["data"],
})
NDJSON = Stream("application/x-ndjson", {"type": "string"})


@dataclass(frozen=True)
class Row:
    """One operation. `content` is the 200 answer's media types (None: JSON, `reply`'s schema
    or any object); `stream` is added to it for a route that can stream. Rows that are not
    `public` (aliases, pages, static files) are served but left out of the document."""

    method: str
    path: str  # Starlette's, convertors included: /v1/images/{sha256:sha256}
    handler: Endpoint | None = None
    summary: str = ""
    operation_id: str = ""
    tags: tuple[str, ...] = ()
    body: Body | None = None
    ok: str = "OK"
    reply: type[BaseModel] | None = None
    content: Mapping[str, Schema] | None = None
    stream: Stream | None = None
    errors: tuple[str, ...] = ()
    error_shape: Errors | None = None
    params: tuple[Param, ...] = ()
    patterns: Mapping[str, str] | None = None  # a path parameter's pattern, over its convertor's
    public: bool = True
    wrappers: tuple[Callable[[Endpoint], Endpoint], ...] = ()  # innermost first: idempotent
    static: Path | None = None  # a directory served under `path` (then no handler)

    @property
    def template(self) -> str:
        """The path as the document (and the HTTP spans) name it: /v1/images/{sha256}."""
        return compile_path(self.path)[1]

    def endpoint(self) -> Endpoint:
        assert self.handler is not None, self.path
        endpoint = self.handler
        for wrap in self.wrappers:
            endpoint = wrap(endpoint)
        return endpoint


def by_method(endpoints: Mapping[str, Endpoint]) -> Endpoint:
    """One endpoint per path for several methods: a 405 then lists every allowed method.
    Starlette lets HEAD through wherever GET is allowed: it is answered as GET."""

    async def route(request: Request) -> Response:
        method = "GET" if request.method == "HEAD" else request.method
        return await endpoints[method](request)

    return route


def _grouped(rows: Iterable[Row], key: Callable[[Row], str]) -> dict[str, list[Row]]:
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return groups


def routes(rows: Iterable[Row]) -> list[BaseRoute]:
    """The Starlette routes of a table, in its order: one Route per path (its methods from
    every row of that path), a Mount for a static directory."""
    made: list[BaseRoute] = []
    for path, group in _grouped(rows, lambda row: row.path).items():
        static = [row for row in group if row.static is not None]
        if static:
            assert len(group) == 1, f"{path}: a static directory and other rows"
            made.append(Mount(path, app=StaticFiles(directory=static[0].static)))
            continue
        endpoints = {row.method: row.endpoint() for row in group}
        assert len(endpoints) == len(group), f"{path}: a method declared twice"
        endpoint = group[0].endpoint() if len(group) == 1 else by_method(endpoints)
        made.append(Route(path, endpoint, methods=list(endpoints)))
    return made


def _path_params(row: Row) -> list[dict[str, Any]]:
    _, _, convertors = compile_path(row.path)
    patterns = row.patterns or {}
    return [{"name": name, "in": "path", "required": True,
             "schema": {"type": "string",
                        "pattern": patterns.get(name, f"^{convertor.regex}$")}}
            for name, convertor in convertors.items()]


def _param(param: Param) -> dict[str, Any]:
    made: dict[str, Any] = {"name": param.name, "in": param.where, "required": param.required,
                            "schema": dict(param.schema)}
    if param.description:
        made["description"] = param.description
    return made


def _request_body(body: Body, schemas: Mapping[str, Any]) -> dict[str, Any]:
    if callable(body.form):
        assert body.model is not None
        schema: Any = dict(body.form(schemas[body.model.__name__]))
    elif body.form is not None:
        schema = dict(body.form)
    else:
        assert body.model is not None
        schema = ref(body.model)
    return {"required": True, "content": {body.media_type: {"schema": schema}}}


def _event_schema(stream: Stream) -> Any:
    return ref(stream.event) if isinstance(stream.event, type) else dict(stream.event)


def _operation(row: Row, schemas: Mapping[str, Any], errors: Errors) -> dict[str, Any]:
    if row.content is not None:
        content = {media: {"schema": dict(schema)} for media, schema in row.content.items()}
    else:
        content = {"application/json": {"schema": ref(row.reply) if row.reply
                                        else dict(JSON_OBJECT)}}
    if row.stream is not None:
        content[row.stream.media_type] = {"schema": _event_schema(row.stream)}
    shape = row.error_shape or errors
    responses: dict[str, Any] = {"200": {"description": row.ok, "content": content}}
    for status in row.errors:
        responses[status] = {"description": shape.described[status], "content": shape.content()}
    operation: dict[str, Any] = {"summary": row.summary, "operationId": row.operation_id}
    if row.tags:
        operation["tags"] = list(row.tags)
    if parameters := [*_path_params(row), *map(_param, row.params)]:
        operation["parameters"] = parameters
    if row.body is not None:
        operation["requestBody"] = _request_body(row.body, schemas)
    operation["responses"] = responses
    return operation


def _models(rows: Iterable[Row], errors: Errors) -> list[type[BaseModel]]:
    found: dict[str, type[BaseModel]] = {}
    for row in rows:
        shape = row.error_shape or errors
        event = row.stream.event if row.stream else None
        for model in (row.body.model if row.body else None, row.reply, shape.model,
                      event if isinstance(event, type) else None):
            if model is not None:
                found.setdefault(model.__name__, model)
    return list(found.values())


def paths_and_schemas(
    rows: Iterable[Row], errors: Errors, extra: Iterable[type[BaseModel]] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The document's `paths` for the public rows (`errors`: the shape of a row that names
    none) and the `components.schemas` of every model they refer to, with `extra`'s."""
    public = [row for row in rows if row.public]
    models = [*_models(public, errors), *extra]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas: dict[str, Any] = defs.get("$defs", {})
    paths: dict[str, Any] = {}
    for template, group in _grouped(public, lambda row: row.template).items():
        paths[template] = {row.method.lower(): _operation(row, schemas, errors) for row in group}
    return paths, schemas

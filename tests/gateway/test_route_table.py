"""The route table is the one declaration of the HTTP surface: every Starlette route of the
built app (gateway and /ui) comes from a row, and every public row is in the OpenAPI document
under the same method and path (and nothing else is)."""

from __future__ import annotations

import httpx
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from fleet.commands.gateway import build_app
from fleet.config import Settings
from fleet.dashboard.routes import API_ROWS, PAGE_ROWS, OpenPages
from fleet.gateway.api_table import gateway_rows, openapi_document
from fleet.gateway.route_table import (
    SSE,
    Body,
    Endpoint,
    Errors,
    Param,
    Row,
    paths_and_schemas,
    routes,
)

ROWS = (*gateway_rows(), *API_ROWS)


def served(route_list: list[BaseRoute]) -> set[tuple[str, str]]:
    found = set()
    for route in route_list:
        if isinstance(route, Mount):
            found.add(("STATIC", route.path))
        else:
            assert isinstance(route, Route)
            found |= {(method, route.path) for method in route.methods or ()} - {
                ("HEAD", route.path)}
    return found


def declared(rows: tuple[Row, ...]) -> set[tuple[str, str]]:
    return {("STATIC" if row.static else row.method, row.path) for row in rows}


def test_every_route_of_the_built_app_comes_from_a_row_and_every_row_is_served() -> None:
    app = build_app(Settings(nats_url="nats://127.0.0.1:1"))
    assert served(app.router.routes) == declared(ROWS)
    pages = OpenPages(app).pages
    assert served(pages.router.routes) == declared(PAGE_ROWS)


def test_a_method_and_path_is_declared_once() -> None:
    keys = [(row.method, row.path) for row in (*ROWS, *PAGE_ROWS)]
    assert len(keys) == len(set(keys))


def test_every_public_row_is_in_the_document_and_nothing_else_is() -> None:
    document = openapi_document()
    operations = {(method.upper(), path) for path, ops in document["paths"].items()
                  for method in ops}
    assert operations == {(row.method, row.template) for row in ROWS if row.public}
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) and all(ids)


async def _hello(request: Request) -> Response:
    return PlainTextResponse(f"{request.method} {request.path_params}")


class Thing(BaseModel):
    name: str


def _twice(endpoint: Endpoint) -> Endpoint:
    async def wrapped(request: Request) -> Response:
        response = await endpoint(request)
        response.headers["x-wrapped"] = "yes"
        return response
    return wrapped


async def test_one_path_with_two_methods_is_one_route_whose_405_lists_both() -> None:
    table = (Row("GET", "/things/{name}", _hello), Row("DELETE", "/things/{name}", _hello,
                                                       wrappers=(_twice,)))
    made = routes(table)
    assert len(made) == 1
    app = Starlette(routes=made)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        assert (await http.get("/things/a")).text == "GET {'name': 'a'}"
        deleted = await http.delete("/things/a")
        assert deleted.text == "DELETE {'name': 'a'}" and deleted.headers["x-wrapped"] == "yes"
        assert (await http.head("/things/a")).status_code == 200  # as GET, no body
        refused = await http.post("/things/a")
        assert refused.status_code == 405
        assert set(refused.headers["allow"].split(", ")) >= {"GET", "DELETE"}


def test_a_row_becomes_an_operation() -> None:
    errors = Errors(described={"404": "Unknown"})
    row = Row("POST", "/v1/things/{thing_id}/{sha256:sha256}", _hello, summary="Make",
              operation_id="make", tags=("T",), body=Body(Thing), stream=SSE,
              errors=("404",), params=(Param("q", "query", {"type": "string"}),),
              patterns={"thing_id": "^[a-z]+$"})
    hidden = Row("GET", "/alias", _hello, public=False)
    paths, schemas = paths_and_schemas((row, hidden), errors)
    assert list(paths) == ["/v1/things/{thing_id}/{sha256}"]
    operation = paths["/v1/things/{thing_id}/{sha256}"]["post"]
    assert operation["operationId"] == "make" and operation["tags"] == ["T"]
    assert [(p["name"], p["in"], p["schema"].get("pattern")) for p in operation["parameters"]] \
        == [("thing_id", "path", "^[a-z]+$"), ("sha256", "path", "^[0-9a-f]{64}$"),
            ("q", "query", None)]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Thing"}
    assert set(operation["responses"]["200"]["content"]) == {"application/json",
                                                             "text/event-stream"}
    assert operation["responses"]["404"]["description"] == "Unknown"
    assert "Thing" in schemas

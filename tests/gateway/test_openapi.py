"""The OpenAPI document is valid OpenAPI 3.1, and a schema-driven fuzz run over every operation
gets answers in the documented shapes: 4xx with an OpenAI error body, never a 500."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings
from schemathesis.checks import load_all_checks
from schemathesis.pytest.lazy import get_all_tests
from schemathesis.specs.openapi.checks import positive_data_acceptance

from fleet.config import Settings
from fleet.gateway.api_table import openapi_document
from fleet.gateway.app import build_app, listening_socket


def test_the_document_is_valid_openapi_3_1() -> None:
    document = openapi_document()
    schemathesis.openapi.from_dict(document).validate()
    assert document["openapi"] == "3.1.0"
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/images/generations",
        "/v1/images/edits",
        "/v1/images/{sha256}",
        "/v1/tasks/{task_id}/cancel",
        "/v1/tasks/{task_id}/events",
        "/healthz",
        "/metrics",
    } <= set(document["paths"])


@pytest.fixture
def live_gateway(settings: Settings) -> Iterator[str]:
    """The gateway on uvicorn in a thread: the fuzzer is synchronous, the app is not.

    Requests that would wait for a worker end at a short deadline (504). The body cap is
    roomy: 413 has its own test, and a fuzzed body past a tight cap hides what it tests."""
    sock = listening_socket("127.0.0.1", 0)
    roomy = replace(settings, gateway_timeout_s=0.2, gateway_max_body_bytes=8 * 1024**2)
    app = build_app(roomy)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http="httptools"))
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),))
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join()
    sock.close()


# The schema is built, and each operation's hypothesis test with it, when this test runs, not
# at collection: collection runs in every xdist worker, and schemathesis's @schema.parametrize()
# built all the operations' tests there (3-5 s of CPU in each process). Its lazy
# `schemathesis.pytest.from_fixture` would do this, but 4.32 sets `Node._nodeid`, which pytest
# 9.2 no longer has. So the test runs the tests that parametrize would have made (the same
# builder: examples, coverage and fuzzing phases, the settings below), one subtest per
# operation reported by its method and path, all against one live gateway. The 34 operations
# once had 300 s each (the suite's limit); together they take 40 s of CPU.
@pytest.mark.timeout(900)
def test_fuzzed_requests_never_get_a_server_error(
    live_gateway: str, subtests: pytest.Subtests
) -> None:
    load_all_checks()
    schema = schemathesis.openapi.from_dict(openapi_document())
    fuzzed = 0
    for built in get_all_tests(schema=schema, test_func=check_a_fuzzed_case, settings=None,
                               given_kwargs={}):
        operation, fuzz = built.ok()  # a schema error raises here, failing the test
        with subtests.test(operation.label):
            fuzz(live_gateway=live_gateway)
        fuzzed += 1
    assert fuzzed == len(openapi_operations())


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def check_a_fuzzed_case(case: schemathesis.Case, live_gateway: str) -> None:
    # Uploaded files are checked for being PNG, JPEG or WebP: no schema can say that, so a
    # schema-valid upload of random bytes is rightly refused.
    # Nor can a document say which JSON Schemas llguidance compiles: a schema-valid
    # response_format of type json_schema may rightly be refused.
    excluded = (
        [positive_data_acceptance]
        if case.operation.path == "/v1/images/edits" or _asks_for_a_json_schema(case.body)
        else []
    )
    case.call_and_validate(base_url=live_gateway, excluded_checks=excluded)


def openapi_operations() -> list[tuple[str, str]]:
    methods = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}
    return [(method, path) for path, item in openapi_document()["paths"].items()
            for method in item if method in methods]


def _asks_for_a_json_schema(body: object) -> bool:
    """Chat's response_format or the Responses API's text.format, of type json_schema."""
    if not isinstance(body, dict):
        return False
    text = body.get("text")
    wanted = [body.get("response_format"), text.get("format") if isinstance(text, dict) else None]
    return any(isinstance(w, dict) and w.get("type") == "json_schema" for w in wanted)

"""Every ask that does not complete says so in the NATS services' way: an ask on a model no
one has is an `ask_error` (model_not_found) with `Nats-Service-Error-Code: 404`, and a task
that failed is an `ask_answer` with its reason and the reason's code in the header too."""

from __future__ import annotations

import nats

from fleet.models.catalog import get_card
from fleet.wire.ask import AskAnswer, AskError
from fleet.wire.codec import ASK_REPLY, decode_with
from fleet.wire.events import ErrorReason
from tests.integration.conftest import WorkerFactory
from tests.integration.harness import serving


async def test_an_unknown_model_and_a_failed_task_answer_with_the_error_headers(
    nats_url: str, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    nc, _ = await serving(nats_url, worker, get_card("tiny-llm"))
    asker = await nats.connect(nats_url)
    try:
        unknown = await asker.request("fleet.ask.no-such-model", b"hello", timeout=60)
        refused = decode_with(ASK_REPLY, unknown.data)
        assert isinstance(refused, AskError) and refused.reason == "model_not_found", refused
        assert "no-such-model" in refused.message
        assert unknown.headers is not None
        assert unknown.headers["Nats-Service-Error-Code"] == "404"
        assert "no-such-model" in unknown.headers["Nats-Service-Error"]

        too_long = await asker.request("fleet.ask.tiny-llm", b"word " * 3000, timeout=120)
        failed = decode_with(ASK_REPLY, too_long.data)
        assert isinstance(failed, AskAnswer), failed
        assert (failed.status, failed.reason) == ("failed", ErrorReason.CONTEXT_LENGTH)
        assert too_long.headers is not None
        assert too_long.headers["Nats-Service-Error-Code"] == "400"

        fine = await asker.request("fleet.ask.tiny-llm", b"hello", timeout=120)
        answered = decode_with(ASK_REPLY, fine.data)
        assert isinstance(answered, AskAnswer) and answered.status == "completed"
        assert not (fine.headers or {}).get("Nats-Service-Error-Code")
    finally:
        await asker.close()
        await nc.close()

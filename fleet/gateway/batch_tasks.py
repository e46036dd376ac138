"""A batch line's body as the task its endpoint would make, and the TaskRecord that renders
its result as that endpoint's response (fleet.gateway.resume.renderer_for). A line is one
task: n > 1, several prompts and streaming are refused for that line alone."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fleet.errors import InvalidParameter
from fleet.gateway.bodies import parse
from fleet.gateway.image_api import ImageGenerationRequest, image_generation_task
from fleet.gateway.responses_api import ResponsesRequest, as_chat
from fleet.gateway.service import Gateway
from fleet.gateway.text_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_task,
    completion_tasks,
    image_urls,
)
from fleet.gateway.vision import check_chat_images
from fleet.wire.records import TaskApi, TaskRecord
from fleet.wire.tasks import Task

API_OF: dict[str, TaskApi] = {
    "/v1/chat/completions": "chat.completions",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/images/generations": "images.generations",
}


def _one(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("stream"):
        raise InvalidParameter("stream: a batch request is answered in the output file", "stream")
    if body.get("n", 1) != 1:
        raise InvalidParameter("n: a batch request makes one choice (send n lines)", "n")
    return body


async def line_task(
    gateway: Gateway, endpoint: str, body: dict[str, Any], task_id: str, batch_id: str,
    tenant: str | None, expires_at: int,
) -> tuple[Task, TaskRecord]:
    """The task of one line (its deadline the job's window) and its record; a line the
    endpoint would refuse raises the same FleetError the endpoint would answer with."""
    now = datetime.now(UTC)
    deadline = datetime.fromtimestamp(expires_at, UTC)
    window_s = max(1.0, expires_at - time.time())
    api = API_OF[endpoint]
    record = TaskRecord(tenant=tenant, api=api, model="", created=int(time.time()))
    task: Task
    match api:
        case "chat.completions" | "responses":
            if api == "responses":
                chat = as_chat(parse(ResponsesRequest, _one(body)))
            else:
                chat = parse(ChatCompletionRequest, _one(body))
            card = gateway.card_for(chat.model, "text_generation")
            chat = chat.model_copy(update={"model": card.id})
            check_chat_images(image_urls(chat))  # before any image is stored
            hashes = {url: await gateway.image_hash(url, tenant) for url in image_urls(chat)}
            task = chat_task(chat, task_id, hashes, now, window_s)
            record = record.model_copy(update={"logprobs": chat.logprobs})
        case "completions":
            completion = parse(CompletionRequest, _one(body))
            if len(completion.prompts) != 1:
                raise InvalidParameter("prompt: one prompt a batch request", "prompt")
            card = gateway.card_for(completion.model, "text_generation")
            completion = completion.model_copy(update={"model": card.id})
            (task,) = completion_tasks(completion, task_id, now, window_s)
            record = record.model_copy(update={
                "logprobs": completion.logprobs is not None,
                "echo": task.prompt if completion.echo else None})
        case _:
            ask = parse(ImageGenerationRequest, _one(body))
            card = gateway.card_for(ask.model, "text_to_image")
            ask = ask.model_copy(update={"model": card.id})
            size = card.image_defaults.size if card.image_defaults else None
            task = image_generation_task(ask, task_id, now, window_s, size)
    task = task.model_copy(update={"deadline": deadline, "batch_id": batch_id,
                                   "priority": "batch", "tenant": tenant})
    return task, record.model_copy(update={"model": task.model})

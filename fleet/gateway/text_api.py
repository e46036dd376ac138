"""The text API: POST /v1/chat/completions, POST /v1/completions and POST /v1/responses."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from fleet.errors import InvalidParameter
from fleet.gateway.auth import tenant_of
from fleet.gateway.bodies import parse, read_json
from fleet.gateway.catalogue import refuses_images
from fleet.gateway.errors import PROMPT_PARAM
from fleet.gateway.image_fetch import fetch_chat_images
from fleet.gateway.relay import Renderer
from fleet.gateway.responses_api import ResponsesRenderer, ResponsesRequest, as_chat, shape_of
from fleet.gateway.service import gateway_of, new_task_id, now_utc, request_id
from fleet.gateway.sessions import session_of
from fleet.gateway.text_replies import ChatRenderer, CompletionRenderer, Reply
from fleet.gateway.text_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_task,
    choice_tasks,
    completion_tasks,
    image_urls,
    refuse_resumable_choices,
)
from fleet.gateway.vision import check_chat_images
from fleet.wire.records import TaskApi
from fleet.wire.tasks import TextGeneration


async def chat_completions(request: Request) -> Response:
    chat = parse(ChatCompletionRequest, await read_json(request))
    return await _chat(request, chat, "chatcmpl", ChatRenderer, "chat.completions")


async def responses(request: Request) -> Response:
    """OpenAI's Responses API: a chat task, answered as a `response` object or its events."""
    body = await read_json(request)
    asked = parse(ResponsesRequest, body)
    PROMPT_PARAM.set("input")  # what a context overflow names
    # The Responses API names a session in the same two fields as chat.
    named = {"prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user")}
    created = int(time.time())

    def renderer(reply: Reply) -> ResponsesRenderer:
        return ResponsesRenderer(shape_of(asked, reply.task_id, created))

    chat = as_chat(asked).model_copy(update=named)
    return await _chat(request, chat, "resp", renderer, "responses")


async def _chat(
    request: Request, chat: ChatCompletionRequest, prefix: str,
    renderer_of: Callable[[Reply], Renderer], api: TaskApi,
) -> Response:
    gateway = gateway_of(request)
    card = gateway.card_for(chat.model, "text_generation")
    chat = chat.model_copy(update={"model": card.id})  # an alias asks for its model
    urls = image_urls(chat)
    if urls and (why := refuses_images(card)):
        raise InvalidParameter(why, "messages")
    sent = await fetch_chat_images(urls, gateway.settings.image_fetch)  # http(s), in limits
    check_chat_images(sent)  # before any image is stored
    hashes = {url: await gateway.image_hash(image, tenant_of(request))
              for url, image in zip(urls, sent, strict=True)}
    timeout_s = gateway.timeout_for(chat.timeout)
    refuse_resumable_choices(chat.n, chat.resumable)
    task = chat_task(chat, new_task_id(prefix), hashes, now_utc(), timeout_s)
    task = task.model_copy(update={"session": session_of(request.headers, chat.session_fields)})
    tasks = choice_tasks(task, chat.n)
    reply = Reply(task.task_id, chat.model, int(time.time()), chat.logprobs, chat.include_usage,
                  _choice_ids(tasks))
    return await gateway.run(
        request,
        tasks,
        renderer_of(reply),
        stream=chat.stream,
        resumable=chat.resumable,
        timeout_s=timeout_s,
        api=api,
        logprobs=chat.logprobs,
        include_usage=chat.include_usage,
    )


async def completions(request: Request) -> Response:
    gateway = gateway_of(request)
    completion = parse(CompletionRequest, await read_json(request))
    PROMPT_PARAM.set("prompt")  # what a context overflow names
    card = gateway.card_for(completion.model, "text_generation")
    completion = completion.model_copy(update={"model": card.id})  # an alias: its model
    timeout_s = gateway.timeout_for(completion.timeout)
    tasks = completion_tasks(completion, new_task_id("cmpl"), now_utc(), timeout_s)
    session = session_of(request.headers, completion.session_fields)
    tasks = [task.model_copy(update={"session": session}) for task in tasks]
    prompts = completion.prompts
    reply = Reply(
        request_id([task.task_id for task in tasks]),
        completion.model,
        int(time.time()),
        completion.logprobs is not None,
        completion.include_usage,
        _choice_ids(tasks),
        per_prompt=completion.n if len(prompts) > 1 else None,
        echo=tuple(task.prompt or "" for task in tasks) if completion.echo else (),
    )
    return await gateway.run(
        request,
        tasks,
        CompletionRenderer(reply),
        stream=completion.stream,
        resumable=completion.resumable,
        timeout_s=timeout_s,
        api="completions",
        logprobs=completion.logprobs is not None,
        include_usage=completion.include_usage,
        echo=reply.echo,
    )


def _choice_ids(tasks: list[TextGeneration]) -> tuple[str, ...]:
    return tuple(task.task_id for task in tasks) if len(tasks) > 1 else ()

"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A Messages request becomes the chat task an OpenAI chat would make (messages_requests), run
through the same gateway service, and its events are answered as a `message` or Anthropic's
SSE events (messages_replies). The model may be named by an alias (the catalogue resolves it,
as for every API), and the reply names the model that answered.

count_tokens is counted by the model's own runner: the conversation runs as a task that makes
one token, and its usage's prompt tokens are the count (exact for the model's chat template
and tools; the prefill also warms the runner's prefix cache for the request that follows).

A stream whose first token is slow (a long prompt's prefill) is committed after a moment,
with message_start and pings while it waits (fleet.gateway.messages_stream): Anthropic's
clients give up on a silent connection.

A task's session (fleet.gateway.sessions) is the `X-Session-Id` header, else the request's
`metadata.user_id` (Claude Code puts its session there).

Errors on these routes are in Anthropic's shape: every error response, whoever made it (a
route, the key check, the body limits, routing), is rewritten by
`fleet.gateway.error_shapes`, so one table (messages_replies.ERROR_TYPES) decides the type
for each status. Clients send
`x-api-key` (fleet.gateway.auth accepts it like a bearer key) and `anthropic-version`,
which is accepted and not checked.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from fleet.errors import InvalidParameter
from fleet.gateway import messages_stream
from fleet.gateway.auth import tenant_of
from fleet.gateway.bodies import parse, read_json
from fleet.gateway.catalogue import refuses_images
from fleet.gateway.image_fetch import fetch_chat_images
from fleet.gateway.messages_replies import (
    MessagesRenderer,
    TokenCountRenderer,
)
from fleet.gateway.messages_requests import CountTokensRequest, MessagesRequest, as_chat
from fleet.gateway.service import gateway_of, new_task_id, now_utc, task_id_headers
from fleet.gateway.sessions import session_of
from fleet.gateway.text_requests import ChatCompletionRequest, chat_task, image_urls
from fleet.gateway.vision import check_chat_images
from fleet.wire.cluster import ModelCard

PATH = "/v1/messages"


async def messages(request: Request) -> Response | messages_stream.EarlyStream:
    asked = parse(MessagesRequest, await read_json(request))
    gateway = gateway_of(request)
    card = gateway.card_for(asked.model, "text_generation")
    chat = as_chat(asked, card.id)
    task_id = new_task_id("msg")
    renderer = MessagesRenderer(task_id, card.id)
    user_id = asked.metadata.user_id if asked.metadata else None
    return await _run(request, card, chat, task_id, renderer, stream=asked.stream,
                      session_fields={"metadata.user_id": user_id})


async def count_tokens(request: Request) -> Response | messages_stream.EarlyStream:
    asked = parse(CountTokensRequest, await read_json(request))
    card = gateway_of(request).card_for(asked.model, "text_generation")
    chat = as_chat(asked, card.id)
    return await _run(request, card, chat, new_task_id("count"), TokenCountRenderer(),
                      stream=False)


async def _run(
    request: Request, card: ModelCard, chat: ChatCompletionRequest, task_id: str,
    renderer: MessagesRenderer | TokenCountRenderer, *, stream: bool,
    session_fields: dict[str, object] | None = None,
) -> Response | messages_stream.EarlyStream:
    gateway = gateway_of(request)
    urls = image_urls(chat)
    if urls and (why := refuses_images(card)):
        raise InvalidParameter(why, "messages")
    sent = await fetch_chat_images(urls, gateway.settings.image_fetch)  # http(s), in limits
    check_chat_images(sent)  # before any image is stored
    hashes = {url: await gateway.image_hash(image, tenant_of(request))
              for url, image in zip(urls, sent, strict=True)}
    timeout_s = gateway.timeout_for(chat.timeout)
    task = chat_task(chat, task_id, hashes, now_utc(), timeout_s)
    # The conversation's session keeps its turns on the runner that holds its prefix.
    task = task.model_copy(update={"session": session_of(request.headers, session_fields)})
    running = asyncio.ensure_future(gateway.run(
        request, [task], renderer, stream=stream, resumable=False, timeout_s=timeout_s,
        api="messages"))
    try:
        if stream and isinstance(renderer, MessagesRenderer):
            done, _ = await asyncio.wait({running}, timeout=messages_stream.EARLY_COMMIT_S)
            if not done:  # a long prefill: the stream is committed now, with pings
                headers = {**task_id_headers([task_id]), "request-id": task_id}
                return messages_stream.EarlyStream(running, renderer, headers)
        response = await running
    except BaseException:
        running.cancel()
        raise
    response.headers["request-id"] = task_id  # where Anthropic's SDKs read a request's id
    return response


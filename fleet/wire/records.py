"""What a gateway records about each task it makes, for every gateway (they keep no state)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.wire.base import TaskId, Wire

TaskApi = Literal[
    "chat.completions", "completions", "responses", "images.generations", "images.edits",
    "messages",
    "embeddings",
]


class TaskRecord(Wire):
    """A task made through a gateway: the tenant that owns it and how it was asked, so any
    gateway can check its owner, answer a resume in the request's own format, and cancel or
    trace an n > 1 request as a whole. KV FLEET_TENANTS, key `task.<task_id>`, kept 1 h (as
    long as FLEET_OUT keeps events); written before the task is published."""

    type: Literal["task_record"] = "task_record"
    tenant: str | None = Field(default=None, description="None: made through an open gateway")
    api: TaskApi = Field(description="The OpenAI endpoint the request came to")
    model: str
    created: int = Field(description="Unix time of the request, as its responses carry it")
    choices: list[TaskId] | None = Field(
        default=None, description="A request with n > 1: its id names no task; these are its "
        "choices' tasks (`<id>-0` …), each with a record of its own",
    )
    logprobs: bool = False
    include_usage: bool = Field(
        default=False, description="The stream ends with a usage chunk (stream_options)"
    )
    echo: str | None = Field(
        default=None, description="A completion asked with `echo`: its prompt, which a "
        "resumed stream repeats first, as the request's own stream did",
    )

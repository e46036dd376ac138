"""OpenAI requests to Fleet tasks: pure, tables."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest

from fleet.errors import InvalidParameter, InvalidRequest
from fleet.gateway.bodies import image_format, image_reference
from fleet.gateway.image_api import (
    ImageEditRequest,
    ImageGenerationRequest,
    edit_form_fields,
    image_edits_task,
    image_generation_task,
)
from fleet.gateway.service import task_id_headers
from fleet.gateway.text_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_task,
    choice_tasks,
    completion_task,
    completion_tasks,
    image_urls,
)
from fleet.wire.tasks import ImagePart, NamedFunction, TextPart

NOW = datetime(2025, 1, 1, tzinfo=UTC)
SHA = "ab" * 32
PNG = b"\x89PNG\r\n\x1a\n" + bytes(8)
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny-llm", "messages": USER, **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"max_tokens": 256, "temperature": 1.0, "stop": [], "logprobs": False}),
        ({"max_tokens": 9}, {"max_tokens": 9}),
        ({"max_tokens": 9, "max_completion_tokens": 5}, {"max_tokens": 5}),
        ({"temperature": 0, "top_p": 0.5, "seed": 3}, {"temperature": 0, "top_p": 0.5, "seed": 3}),
        ({"stop": "\n"}, {"stop": ["\n"]}),
        ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
        ({"logprobs": True, "top_logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
        ({"logit_bias": {"42": -100}}, {"logit_bias": {42: -100.0}}),
        ({"top_k": 40, "min_p": 0.05}, {"top_k": 40, "min_p": 0.05}),
        ({"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.1},
         {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.1}),
        ({"presence_penalty": None}, {"presence_penalty": 0.0, "repetition_penalty": None}),
        ({"user": "someone", "store": True, "metadata": {"a": "b"}}, {"max_tokens": 256}),
    ],
)
def test_chat_sampling_fields(fields: dict, expected: dict) -> None:
    task = chat_task(chat(**fields), "chatcmpl-1", {}, NOW, 30.0)
    assert {name: getattr(task, name) for name in expected} == expected
    assert task.deadline == NOW + timedelta(seconds=30)
    assert task.created_at == NOW


def test_chat_messages_keep_roles_tools_and_images_by_hash() -> None:
    url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = chat(messages=messages, tools=tools)
    assert image_urls(request) == [url]
    task = chat_task(request, "chatcmpl-1", {url: SHA}, NOW, 30.0)
    assert [m.role for m in task.messages or []] == ["system", "user", "assistant", "tool"]
    assert task.messages[1].content == [TextPart(text="what?"), ImagePart(sha256=SHA)]
    assert task.messages[2].tool_calls[0].function.name == "f"
    assert task.messages[3].tool_call_id == "c1"
    assert task.tools and task.tools[0].function.name == "f"
    assert chat_task(chat(tools=tools, tool_choice="none"), "c", {}, NOW, 1).tools is None


def test_a_forced_tool_choice_reaches_the_task_and_a_wrong_one_is_a_400() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "f"}}
    assert chat_task(chat(tools=tools, tool_choice=named), "c", {}, NOW, 1).tool_choice == (
        NamedFunction(name="f")
    )
    assert chat_task(chat(tools=tools, tool_choice="required"), "c", {}, NOW, 1).tool_choice == (
        "required"
    )
    assert chat_task(chat(tools=tools, tool_choice="auto"), "c", {}, NOW, 1).tool_choice == "auto"
    json_mode = {"type": "json_object"}
    for wrong in [
        chat(tool_choice="required"),
        chat(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}),
        chat(tools=tools, tool_choice="required", response_format=json_mode),
    ]:
        with pytest.raises(InvalidParameter) as caught:
            chat_task(wrong, "c", {}, NOW, 1)
        assert caught.value.param == "tool_choice"


def test_what_only_the_task_rejects_is_still_a_400_naming_the_param() -> None:
    tools = [{"type": "function", "function": {"name": "has space"}}]
    with pytest.raises(InvalidParameter) as caught:
        chat_task(chat(tools=tools), "chatcmpl-1", {}, NOW, 1.0)
    assert caught.value.param == "tools.0.function.name"


def completions(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "tiny-llm", "prompt": "x", **fields})


def test_a_prompt_list_is_one_choice_per_prompt_times_n_in_prompt_order() -> None:
    tasks = completion_tasks(completions(prompt=["a", "b"], n=2, seed=7), "cmpl-1", NOW, 5.0)
    assert [(t.task_id, t.prompt, t.seed) for t in tasks] == [
        ("cmpl-1-0", "a", 7), ("cmpl-1-1", "a", 8), ("cmpl-1-2", "b", 7), ("cmpl-1-3", "b", 8)]
    [one] = completion_tasks(completions(prompt=["only"]), "cmpl-2", NOW, 5.0)
    assert (one.task_id, one.prompt) == ("cmpl-2", "only")


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": ["p"] * 9, "n": 2}, "n"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"prompt": ["a", "b"], "stream": True, "resumable": True}, "n"),
])
def test_completions_that_cannot_be_served_name_the_parameter(
    fields: dict[str, object], param: str
) -> None:
    with pytest.raises(InvalidParameter) as caught:
        completion_tasks(completions(**fields), "cmpl-1", NOW, 5.0)
    assert caught.value.param == param


def test_completion_task_defaults_like_openai() -> None:
    request = CompletionRequest.model_validate({"model": "tiny-llm", "prompt": ["once upon"]})
    task = completion_task(request, "cmpl-1", NOW, 5.0)
    assert (task.prompt, task.messages, task.max_tokens) == ("once upon", None, 16)
    logprobs = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 2})
    task = completion_task(logprobs, "cmpl-2", NOW, 5.0)
    assert (task.logprobs, task.top_logprobs) == (True, 2)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"https://gateway.example/v1/images/{SHA}", SHA),
        (SHA, SHA),
        ("data:image/png;base64," + base64.b64encode(PNG).decode(), PNG),
        ("data:;base64," + base64.b64encode(PNG).decode(), PNG),
    ],
)
def test_image_references(url: str, expected: object) -> None:
    assert image_reference(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "data:image/png;base64,###",
        "data:image/png," + PNG.decode("latin-1"),
        "data:image/png;base64," + base64.b64encode(b"GIF89a....").decode(),
        f"https://gateway.example/v1/images/{SHA.upper()}",
    ],
)
def test_unusable_image_references(url: str) -> None:
    with pytest.raises(InvalidRequest):
        image_reference(url)


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (PNG, "png"),
        (b"\xff\xd8\xff\xe0" + bytes(8), "jpeg"),
        (b"RIFF\x10\x00\x00\x00WEBPVP8 ", "webp"),
        (b"GIF89a", None),
        (b"", None),
    ],
)
def test_image_format_sniffing(data: bytes, kind: str | None) -> None:
    assert image_format(data) == kind


def test_image_generation_task() -> None:
    request = ImageGenerationRequest.model_validate(
        {
            "model": "tiny-flux2",
            "prompt": "fox",
            "n": 2,
            "output_format": "webp",
            "partial_images": 2,
            "steps": 3,
        }
    )
    task = image_generation_task(request, "img-1", NOW, 60.0, default_size="256x256")
    assert (task.size, task.n, task.output_format, task.steps) == ("256x256", 2, "webp", 3)
    assert task.partial_images == 0  # previews only travel in a stream
    streamed = request.model_copy(update={"stream": True, "size": "64x32"})
    task = image_generation_task(streamed, "img-2", NOW, 60.0, default_size="256x256")
    assert (task.partial_images, task.width, task.height) == (2, 64, 32)


def test_image_edit_form_to_task() -> None:
    form = {"model": "tiny-flux2", "prompt": "greener", "strength": "0.3", "image": object()}
    request = ImageEditRequest.model_validate(edit_form_fields(form))
    task = image_edits_task(request, "img-3", [SHA], NOW, 60.0)
    assert (task.input_images, task.strength, task.size) == ([SHA], 0.3, "512x512")
    with pytest.raises(InvalidRequest, match="mask"):
        edit_form_fields({**form, "mask": object()})


def test_the_task_id_headers_name_the_request_and_its_choices() -> None:
    assert task_id_headers(["chatcmpl-x"]) == {"x-fleet-task-id": "chatcmpl-x"}
    assert task_id_headers(["c-0", "c-1"]) == {
        "x-fleet-task-id": "c", "x-fleet-choice-task-ids": "c-0,c-1"}


def test_each_choice_is_a_task_with_the_next_seed() -> None:
    task = chat_task(chat(seed=7, n=3), "chatcmpl-x", {}, NOW, 5.0)
    choices = choice_tasks(task, 3)
    assert [(c.task_id, c.seed) for c in choices] == [
        ("chatcmpl-x-0", 7), ("chatcmpl-x-1", 8), ("chatcmpl-x-2", 9),
    ]
    assert choices[1].messages == task.messages
    assert choice_tasks(task, 1) == [task]
    top = choice_tasks(chat_task(chat(seed=2**63 - 1), "c", {}, NOW, 5.0), 2)
    assert [c.seed for c in top] == [2**63 - 1, 2**63 - 2]
    unseeded = choice_tasks(chat_task(chat(), "c", {}, NOW, 5.0), 2)
    assert [c.seed for c in unseeded] == [None, None]

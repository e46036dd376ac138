"""Tasks published on `fleet.tasks.<model>` and the cancel command."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, Field, model_validator

from fleet.wire.base import ModelId, Part, Sha256Hex, TaskId, Wire

Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what orjson can encode


class TextPart(Part):
    type: Literal["text"] = "text"
    text: str


class ImagePart(Part):
    """An image by the sha256 of its bytes in the FLEET_IMAGES object store."""

    type: Literal["image"] = "image"
    sha256: Sha256Hex


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(Part):
    name: str
    arguments: str = Field(description="JSON-encoded arguments, as OpenAI sends them")


class ToolCall(Part):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Part):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def image_hashes(self) -> list[str]:
        if isinstance(self.content, list):
            return [part.sha256 for part in self.content if isinstance(part, ImagePart)]
        return []


class FunctionSpec(Part):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class Tool(Part):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(Part):
    type: Literal["function"] = "function"
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")


ToolChoice = Literal["auto", "required"] | NamedFunction


# Priority classes, highest first (fleet.worker.priority has the dispatch rules).
Priority = Literal["interactive", "default", "batch"]


class _TaskBase(Wire):
    task_id: TaskId
    model: ModelId
    priority: Priority = Field(
        default="default",
        description="Its priority class, published on fleet.tasks.<model>[.<class>]: workers "
        "pull interactive before default before batch (a batch job's lines are batch)",
    )
    tenant: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="The tenant that asked (set by the gateway from the request's API key): "
        "the unit of fair sharing within a class (fleet/bus/fairness.py)",
    )
    deadline: AwareDatetime | None = Field(
        default=None, description="The task expires if it has not started by then"
    )
    created_at: AwareDatetime | None = None
    batch_id: TaskId | None = Field(
        default=None, description="The batch job (/v1/batches) this task is a request line of"
    )
    max_continuations: int = Field(
        default=3, ge=0, le=16,
        description="How many times a text task whose worker died after its output began is "
        "continued by another worker before it ends failed/worker_lost",
    )


class ResponseFormat(Part):
    """What shape the text must take; the runner masks every token that would break it."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = Field(
        default=None, description="The JSON Schema the output matches (type json_schema only)"
    )

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type json_schema, and only then")
        return self


class TextGeneration(_TaskBase):
    """A chat (messages) or plain completion (prompt) request; fields follow OpenAI's."""

    type: Literal["text_generation"] = "text_generation"
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int = Field(default=256, ge=1, le=131072)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: list[str] = Field(default_factory=list, max_length=8)
    tools: list[Tool] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0,
        description="Subtracted once from the logit of every token the completion has used",
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0,
        description="Subtracted from a token's logit once per time the completion used it",
    )
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, le=10.0,
        description="mlx-lm's multiplicative penalty on the last 20 tokens, prompt included",
    )
    response_format: ResponseFormat | None = None
    tool_choice: ToolChoice = Field(
        default="auto",
        description="auto: the model decides; required: it calls one or more of the tools; "
        "a named function: it calls that one. The last two are enforced token by token.",
    )
    session: str | None = Field(
        default=None, max_length=256,
        description="The conversation this turn belongs to (X-Session-Id, OpenAI's "
        "prompt_cache_key or user, Anthropic's metadata.user_id): the worker routes its turns "
        "to the runner that served the earlier ones (their prefix cache), and traces carry it",
    )

    @model_validator(mode="after")
    def _one_input(self) -> TextGeneration:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of 'messages' or 'prompt' is required")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' must not be empty")
        return self

    @model_validator(mode="after")
    def _choice_among_tools(self) -> TextGeneration:
        names = [tool.function.name for tool in self.tools or []]
        if self.tool_choice != "auto" and not names:
            raise ValueError("'tool_choice' other than auto needs 'tools'")
        if isinstance(self.tool_choice, NamedFunction) and self.tool_choice.name not in names:
            raise ValueError(f"'tool_choice' names {self.tool_choice.name!r}, not one of the tools")
        if self.tool_choice != "auto" and self.response_format is not None:
            raise ValueError("'tool_choice' and 'response_format' cannot both shape the output")
        return self

    def image_hashes(self) -> list[str]:
        return [h for m in self.messages or [] for h in m.image_hashes()]


ImageSize = Annotated[str, Field(pattern=r"^[1-9][0-9]{1,4}x[1-9][0-9]{1,4}$")]


class _ImageTaskBase(_TaskBase):
    prompt: str = Field(min_length=1)
    size: ImageSize = "512x512"
    n: int = Field(default=1, ge=1, le=8)
    steps: int | None = Field(default=None, ge=1, le=200)
    guidance: float | None = Field(default=None, ge=0.0, le=50.0)
    seed: Seed | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"
    partial_images: int = Field(default=0, ge=0, le=8)

    @property
    def width(self) -> int:
        return int(self.size.split("x")[0])

    @property
    def height(self) -> int:
        return int(self.size.split("x")[1])


class ImageGeneration(_ImageTaskBase):
    """Text to image; fields follow OpenAI's images API."""

    type: Literal["image_generation"] = "image_generation"

    def image_hashes(self) -> list[str]:
        return []


class ImageEdits(_ImageTaskBase):
    """Image to image: input images by sha256 in FLEET_IMAGES, and how far to move from them."""

    type: Literal["image_edits"] = "image_edits"
    input_images: list[Sha256Hex] = Field(min_length=1, max_length=8)
    strength: float = Field(default=0.6, gt=0.0, le=1.0)

    def image_hashes(self) -> list[str]:
        return list(self.input_images)


EmbeddingText = Annotated[str, Field(min_length=1)]
# A token id fits 31 bits in every vocabulary (the schema says so, so a client or a fuzzer
# knows a larger number is no token).
MAX_TOKEN_ID = 2**31 - 1
TokenArray = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]


class Embeddings(_TaskBase):
    """Texts (or token arrays) in, one vector per input out, as `embedding` events; fields
    follow OpenAI's embeddings API. The card's `embedding` says how vectors are pooled."""

    type: Literal["embeddings"] = "embeddings"
    input: list[EmbeddingText] | list[TokenArray] = Field(min_length=1, max_length=2048)
    dimensions: int | None = Field(
        default=None, ge=1, description="Cut each vector to this many dimensions and "
        "normalise it again; only for a card whose embedding is `truncatable`",
    )
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="How the `embedding` events carry vectors: JSON numbers, "
        "or base64 of little-endian float32 (a quarter of the bytes, exact)",
    )
    truncate: bool = Field(
        default=False, description="Cut an input longer than the model's context to fit "
        "(Ollama's default); false: such an input fails the task (context_length)",
    )

    def image_hashes(self) -> list[str]:
        return []


Task = Annotated[
    TextGeneration | ImageGeneration | ImageEdits | Embeddings, Field(discriminator="type")
]


class CancelTask(Wire):
    """Published on `fleet.cancel.<task_id>`; also recorded so an early cancel is honoured."""

    type: Literal["cancel_task"] = "cancel_task"
    task_id: TaskId
    reason: str | None = None


# The TaskId pattern of fleet.wire.base, whole-string: an id is one subject token of at most 128
# characters, so `fleet.out.<id>` names exactly one task. Anything else is refused as it is,
# never cut or cleaned onto another id (a cut 200-character id would land on a shorter one).
_TASK_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def is_task_id(value: object) -> bool:
    """True when `value` may be used as a task id, exactly as given."""
    return isinstance(value, str) and _TASK_ID.fullmatch(value) is not None


def is_past(deadline: datetime | None, now: datetime) -> bool:
    return deadline is not None and now >= deadline


def sampling_seed(task: Task) -> int | None:
    """The seed a sampled text task draws its tokens with (recorded in its task_accepted)."""
    if isinstance(task, TextGeneration) and task.temperature > 0.0:
        return task.seed
    return None

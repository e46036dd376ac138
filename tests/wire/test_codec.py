"""The codec: every wire model round-trips; strict decoding names what is wrong.

Round trips use the examples `fleet schemas` publishes plus hypothesis property tests over the
named unions (Task, OutputEvent, ClusterEvent, RunnerStatus).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, get_args

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from fleet.wire import cluster, codec, events, pipe, runners, tasks
from fleet.wire.ask import AskReply
from fleet.wire.batches import BatchLease, BatchRecord, BatchResult, FileRecord, IdempotencyRecord
from fleet.wire.codec import DecodeError, decode_model, decode_with, encode
from fleet.wire.examples import NATS_CLI_TASK, examples
from fleet.wire.fairness import TenantShare
from fleet.wire.handoff import HandOffAnswer, TaskHandOff
from fleet.wire.prefixes import PrefixSummary
from fleet.wire.records import TaskRecord
from fleet.wire.ring import StepPlan
from fleet.wire.uploads import UPLOAD_REPLY, UploadReply

FAST = settings(max_examples=100, deadline=None)


def members(union: Any) -> tuple[type[BaseModel], ...]:
    """The classes of an `Annotated[A | B | ..., Field(discriminator=...)]` union."""
    return get_args(get_args(union)[0])


UNION_DECODERS: list[tuple[Any, TypeAdapter[Any]]] = [
    (tasks.Task, codec.TASK),
    (events.OutputEvent, codec.OUTPUT_EVENT),
    (cluster.ClusterEvent, codec.CLUSTER_EVENT),
    (runners.RunnerStatus, codec.RUNNER_STATUS),
    (AskReply, codec.ASK_REPLY),
    (UploadReply, UPLOAD_REPLY),
    (pipe.RunnerCommand, pipe.COMMAND),
    (pipe.RunnerReport, pipe.REPORT),
]

# ---- examples ---------------------------------------------------------------------------

EXAMPLES = examples()


@pytest.mark.parametrize("stem", sorted(EXAMPLES))
def test_every_example_round_trips_through_its_own_model(stem: str) -> None:
    message = EXAMPLES[stem]
    decoded = decode_model(type(message), encode(message))
    assert decoded == message
    assert type(decoded) is type(message)


@pytest.mark.parametrize("stem", sorted(EXAMPLES))
def test_every_example_round_trips_through_each_union_that_holds_it(stem: str) -> None:
    message = EXAMPLES[stem]
    unions = [adapter for union, adapter in UNION_DECODERS if type(message) in members(union)]
    for adapter in unions:
        assert decode_with(adapter, encode(message)) == message
    standalone = type(message) in {
        tasks.CancelTask, cluster.ModelCard, cluster.NodeInfo, cluster.NodeCapabilities,
        cluster.CapabilitiesKeeper, cluster.Instance,
        cluster.RunnerRecord, pipe.RunnerSpec, events.TaskRefused, events.TaskFence,
        PrefixSummary,
        TaskHandOff, HandOffAnswer, StepPlan, TaskRecord,
        FileRecord, BatchRecord, BatchResult, BatchLease, IdempotencyRecord, TenantShare,
    }
    assert unions or standalone, f"{stem}: no union and no standalone family decodes it"


def test_union_decoders_pick_the_class_named_by_type() -> None:
    assert isinstance(codec.decode_task(encode(EXAMPLES["image_edits"])), tasks.ImageEdits)
    assert isinstance(codec.decode_event(encode(EXAMPLES["token"])), events.TokenChunk)
    decoded = decode_with(codec.CLUSTER_EVENT, encode(EXAMPLES["node_left"]))
    assert isinstance(decoded, cluster.NodeLeft)


def test_nats_cli_task_decodes_from_plain_json_without_defaults() -> None:
    raw = orjson.dumps({
        "type": "text_generation", "task_id": "hello-1", "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32, "temperature": 0.0,
    })
    assert codec.decode_task(raw) == NATS_CLI_TASK


def test_encode_leaves_out_fields_that_are_none() -> None:
    data = orjson.loads(encode(NATS_CLI_TASK))
    assert "seed" not in data and "deadline" not in data
    assert data["schema_version"] == 1


# ---- hypothesis strategies over the unions ---------------------------------------------

ids = st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True)
model_ids = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,30}", fullmatch=True)
sha256s = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
texts = st.text(max_size=30)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
finite = st.floats(allow_nan=False, allow_infinity=False)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
counts = st.integers(min_value=0, max_value=2**31 - 1)  # a token id fits 31 bits (MAX_TOKEN_ID)
aware = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)
sizes = st.builds(
    lambda w, h: f"{w}x{h}", st.integers(10, 99999), st.integers(10, 99999)
)
json_leaf = st.none() | st.booleans() | int64 | finite | texts
json_values = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)


def opt(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


content_parts = st.lists(
    st.builds(tasks.TextPart, text=texts) | st.builds(tasks.ImagePart, sha256=sha256s),
    max_size=3,
)
tool_calls = st.builds(
    tasks.ToolCall, id=ids, function=st.builds(tasks.FunctionCall, name=texts, arguments=texts)
)
chat_messages = st.builds(
    tasks.ChatMessage,
    role=st.sampled_from(["system", "user", "assistant", "tool"]),
    content=opt(texts | content_parts),
    name=opt(texts),
    tool_calls=opt(st.lists(tool_calls, max_size=2)),
    tool_call_id=opt(ids),
)
tools = st.builds(
    tasks.Tool,
    function=st.builds(
        tasks.FunctionSpec,
        name=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True),
        description=opt(texts),
        parameters=st.dictionaries(texts, json_values, max_size=3),
    ),
)
task_base = {"task_id": ids, "model": model_ids, "deadline": opt(aware), "created_at": opt(aware)}


@st.composite
def text_generations(draw: st.DrawFn) -> tasks.TextGeneration:
    as_chat = draw(st.booleans())
    return tasks.TextGeneration(
        **{k: draw(v) for k, v in task_base.items()},
        messages=draw(st.lists(chat_messages, min_size=1, max_size=3)) if as_chat else None,
        prompt=None if as_chat else draw(texts),
        max_tokens=draw(st.integers(1, 131072)),
        temperature=draw(st.floats(0.0, 2.0)),
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True)),
        top_k=draw(st.integers(0, 2**31)),
        min_p=draw(st.floats(0.0, 1.0)),
        seed=draw(opt(int64)),
        stop=draw(st.lists(texts, max_size=8)),
        tools=draw(opt(st.lists(tools, max_size=2))),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(st.integers(0, 20)),
        logit_bias=draw(opt(st.dictionaries(st.integers(0, 2**31), finite, max_size=3))),
    )


image_fields = {
    **task_base,
    "prompt": st.text(min_size=1, max_size=30),
    "size": sizes,
    "n": st.integers(1, 8),
    "steps": opt(st.integers(1, 200)),
    "guidance": opt(st.floats(0.0, 50.0)),
    "seed": opt(int64),
    "output_format": st.sampled_from(["png", "jpeg", "webp"]),
    "partial_images": st.integers(0, 8),
}
any_task = st.one_of(
    text_generations(),
    st.builds(tasks.ImageGeneration, **image_fields),
    st.builds(
        tasks.ImageEdits,
        **image_fields,
        input_images=st.lists(sha256s, min_size=1, max_size=8),
        strength=st.floats(0.0, 1.0, exclude_min=True),
    ),
    st.builds(
        tasks.Embeddings,
        **task_base,
        input=st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=4)
        | st.lists(st.lists(st.integers(0, tasks.MAX_TOKEN_ID), min_size=1, max_size=5), min_size=1,
                   max_size=4),
        dimensions=opt(st.integers(1, 4096)),
        encoding_format=st.sampled_from(["float", "base64"]),
        truncate=st.booleans(),
    ),
)

event_base = {"task_id": ids, "at": times}
error_reasons = st.sampled_from(list(events.ErrorReason))
any_output_event = st.one_of(
    st.builds(
        events.TaskAccepted, **event_base, model=model_ids, node_id=ids, runner_id=ids,
        trace_id=opt(st.from_regex(r"[0-9a-f]{32}", fullmatch=True)), queue_wait_s=finite,
        delivery=counts,
    ),
    st.builds(
        events.TokenChunk, **event_base, index=counts, token_id=int64, text=texts,
        logprob=opt(finite),
        top_logprobs=opt(st.lists(
            st.builds(events.TopLogprob, token=texts, token_id=int64, logprob=finite),
            max_size=3,
        )),
    ),
    st.builds(
        events.ToolCallChunk, **event_base, index=counts, id=texts, name=texts, arguments=texts
    ),
    st.builds(
        events.ImageChunk, **event_base, sha256=sha256s, image_index=counts,
        partial_index=opt(counts), partial_total=opt(counts),
        format=st.sampled_from(["png", "jpeg", "webp"]), width=counts, height=counts,
        size_bytes=counts,
        stats=opt(st.builds(
            events.ImageStats, seconds_per_step=finite, total_s=finite, steps=counts
        )),
    ),
    st.builds(
        events.EmbeddingChunk, **event_base, index=counts,
        encoding_format=st.sampled_from(["float", "base64"]), dimensions=st.integers(1, 4096),
        embeddings=st.lists(st.lists(finite, max_size=4), min_size=1, max_size=3)
        | st.lists(texts, min_size=1, max_size=3),
        forward_pass=st.integers(1, 2**31),
    ),
    st.builds(events.ErrorChunk, **event_base, reason=error_reasons, message=texts),
    st.builds(
        events.TaskFinished, **event_base,
        status=st.sampled_from(["completed", "failed", "cancelled", "expired"]),
        finish_reason=opt(st.sampled_from(["stop", "length", "tool_calls"])),
        reason=opt(error_reasons), message=opt(texts),
        usage=opt(st.builds(
            events.Usage, prompt_tokens=counts, completion_tokens=counts, total_tokens=counts
        )),
        stats=opt(st.builds(
            events.TaskStats, queue_wait_s=opt(finite), time_to_first_token_s=opt(finite),
            tokens_per_s=opt(finite), prompt_tokens_per_s=opt(finite), total_s=opt(finite),
            batched_with=opt(counts),
        )),
        node_id=opt(ids), runner_id=opt(ids),
    ),
)

any_runner_status = st.one_of(
    st.builds(runners.RunnerIdle),
    st.builds(runners.RunnerDownloading, bytes_done=counts, bytes_total=counts),
    st.builds(runners.RunnerConnecting),
    st.builds(runners.RunnerConnected),
    st.builds(runners.RunnerLoading, layers_done=counts, layers_total=counts),
    st.builds(runners.RunnerLoaded),
    st.builds(runners.RunnerWarmingUp),
    st.builds(runners.RunnerReady),
    st.builds(runners.RunnerRunning, active_tasks=counts),
    st.builds(runners.RunnerShuttingDown),
    st.builds(runners.RunnerShutdown),
    st.builds(runners.RunnerFailed, error=texts),
)

instances = st.builds(
    cluster.Instance, instance_id=ids, model=model_ids, created_at=times,
    slots=st.integers(1, 256),
    shards=st.lists(
        st.builds(
            cluster.ShardAssignment, node_id=ids, runner_id=ids, rank=counts,
            world_size=counts, start_layer=counts, end_layer=counts,
        ),
        min_size=1, max_size=3,
    ),
)
runner_where = {"runner_id": ids, "instance_id": ids, "node_id": ids, "model": model_ids}
any_cluster_event = st.one_of(
    st.builds(cluster.RunnerStatusChanged, **runner_where, status=any_runner_status, at=times),
    st.builds(cluster.NodeJoined, node_id=ids, hostname=texts, at=times),
    st.builds(cluster.NodeLeft, node_id=ids, at=times),
)


def test_strategies_cover_every_member_of_each_union() -> None:
    # A new class in a union must get a strategy here, or the property tests go blind to it.
    covered = {
        tasks.Task: {
            tasks.TextGeneration, tasks.ImageGeneration, tasks.ImageEdits, tasks.Embeddings,
        },
        events.OutputEvent: {
            events.TaskAccepted, events.TokenChunk, events.ToolCallChunk, events.ImageChunk,
            events.EmbeddingChunk, events.ErrorChunk, events.TaskFinished,
        },
        cluster.ClusterEvent: {
            cluster.RunnerStatusChanged, cluster.NodeJoined, cluster.NodeLeft,
        },
        runners.RunnerStatus: {
            runners.RunnerIdle, runners.RunnerDownloading, runners.RunnerConnecting,
            runners.RunnerConnected,
            runners.RunnerLoading, runners.RunnerLoaded, runners.RunnerWarmingUp,
            runners.RunnerReady, runners.RunnerRunning, runners.RunnerShuttingDown,
            runners.RunnerShutdown, runners.RunnerFailed,
        },
    }
    for union, classes in covered.items():
        assert set(members(union)) == classes


@FAST
@given(any_task)
def test_any_task_round_trips(task: tasks.TextGeneration) -> None:
    assert codec.decode_task(encode(task)) == task


@FAST
@given(any_output_event)
def test_any_output_event_round_trips(event: BaseModel) -> None:
    assert codec.decode_event(encode(event)) == event


@FAST
@given(any_cluster_event)
def test_any_cluster_event_round_trips(event: BaseModel) -> None:
    assert decode_with(codec.CLUSTER_EVENT, encode(event)) == event


@FAST
@given(any_runner_status)
def test_any_runner_status_round_trips(status: BaseModel) -> None:
    assert decode_with(codec.RUNNER_STATUS, encode(status)) == status


@settings(max_examples=30, deadline=None)
@given(any_task, st.text(max_size=20), st.floats(0, 1e6, allow_nan=False))
def test_a_task_travels_inside_a_submit_command_unchanged(
    task: tasks.TextGeneration, traceparent: str, wait: float
) -> None:
    command = pipe.SubmitTask(task=task, traceparent=traceparent, queue_wait_s=wait)
    assert decode_with(pipe.COMMAND, encode(command)) == command


# ---- strict decoding ---------------------------------------------------------------------

def task_json(**changes: Any) -> dict[str, Any]:
    data = orjson.loads(encode(NATS_CLI_TASK))
    data.update(changes)
    return {k: v for k, v in data.items() if v is not ...}


def decode_error(data: dict[str, Any] | bytes) -> DecodeError:
    raw = data if isinstance(data, bytes) else orjson.dumps(data)
    with pytest.raises(DecodeError) as caught:
        codec.decode_task(raw)
    return caught.value


def test_unknown_field_is_rejected_and_named() -> None:
    error = decode_error(task_json(temprature=0.5))
    assert "temprature" in str(error)
    assert "Extra inputs are not permitted" in str(error)


def test_unknown_field_in_a_nested_part_is_rejected_and_named() -> None:
    message = {"role": "user", "content": "hi", "mood": "curious"}
    error = decode_error(task_json(messages=[message]))
    assert "messages.0.mood" in str(error)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "many"),
        ("temperature", "hot"),
        ("stop", "not-a-list-of-strings"),
        ("messages", {"role": "user"}),
        ("logprobs", [1, 2]),
    ],
)
def test_wrong_type_is_rejected_and_the_field_named(field: str, value: object) -> None:
    error = decode_error(task_json(**{field: value}))
    assert field in str(error)


def test_out_of_range_value_is_rejected_and_named() -> None:
    error = decode_error(task_json(temperature=3.5))
    assert "temperature" in str(error)


def test_missing_type_is_rejected_and_names_the_tag() -> None:
    error = decode_error(task_json(type=...))
    assert "'type'" in str(error)


def test_unknown_type_is_rejected_and_lists_the_known_ones() -> None:
    error = decode_error(task_json(type="speech_to_text"))
    assert "speech_to_text" in str(error)
    assert "text_generation" in str(error)


def test_missing_required_field_is_named() -> None:
    error = decode_error(task_json(model=...))
    assert "model" in str(error)
    assert "Field required" in str(error)


def test_wrong_schema_version_is_rejected() -> None:
    error = decode_error(task_json(schema_version=2))
    assert "schema_version" in str(error)


def test_undecodable_bytes_are_a_decode_error_without_a_task_id() -> None:
    error = decode_error(b"\xff{not json")
    assert "not JSON" in str(error)
    assert error.task_id is None


def test_json_that_is_not_an_object_is_a_decode_error() -> None:
    error = decode_error(b"[1, 2, 3]")
    assert error.task_id is None


def test_runner_status_without_state_is_rejected_and_names_the_tag() -> None:
    with pytest.raises(DecodeError, match="'state'"):
        decode_with(codec.RUNNER_STATUS, b'{"error": "boom"}')


def test_event_with_an_unknown_field_is_rejected() -> None:
    data = orjson.loads(encode(EXAMPLES["token"]))
    data["colour"] = "red"
    with pytest.raises(DecodeError, match="colour"):
        codec.decode_event(orjson.dumps(data))


def test_decode_model_is_strict_about_unknown_fields_too() -> None:
    data = orjson.loads(encode(EXAMPLES["node_info"]))
    data["gpu_count"] = 8
    with pytest.raises(DecodeError, match="gpu_count"):
        decode_model(cluster.NodeInfo, orjson.dumps(data))


# ---- the task id travels with the error --------------------------------------------------

def test_schema_violation_carries_the_readable_task_id() -> None:
    error = decode_error(task_json(task_id="order-42", max_tokens=0))
    assert error.task_id == "order-42"
    assert "max_tokens" in str(error)


def test_schema_violation_of_an_event_carries_the_task_id() -> None:
    data = orjson.loads(encode(EXAMPLES["token"]))
    data["index"] = -1
    with pytest.raises(DecodeError) as caught:
        codec.decode_event(orjson.dumps(data))
    assert caught.value.task_id == "chat-1"


@pytest.mark.parametrize("task_id", ["a.b", "a b", "fleet.>", 42, "", None])
def test_unreadable_task_id_is_not_carried(task_id: object) -> None:
    error = decode_error(task_json(task_id=task_id))
    assert error.task_id is None


def test_task_id_is_carried_even_when_the_type_is_missing() -> None:
    error = decode_error(task_json(type=..., task_id="no-type-1"))
    assert error.task_id == "no-type-1"


# ---- TextGeneration: exactly one of messages / prompt --------------------------------------

def test_text_generation_with_both_messages_and_prompt_is_rejected() -> None:
    error = decode_error(task_json(prompt="Once upon a time"))
    assert "exactly one of 'messages' or 'prompt'" in str(error)


def test_text_generation_with_neither_messages_nor_prompt_is_rejected() -> None:
    error = decode_error(task_json(messages=...))
    assert "exactly one of 'messages' or 'prompt'" in str(error)


def test_text_generation_with_empty_messages_is_rejected() -> None:
    error = decode_error(task_json(messages=[]))
    assert "'messages' must not be empty" in str(error)


def test_text_generation_with_only_a_prompt_is_accepted() -> None:
    task = codec.decode_task(orjson.dumps(task_json(messages=..., prompt="Once upon a time")))
    assert isinstance(task, tasks.TextGeneration)
    assert task.prompt == "Once upon a time" and task.messages is None


# ---- subject-safe ids ------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["smollm2.135m", "smollm2 135m", "tiny>", "tiny*", "Tiny-LLM"])
def test_model_id_that_is_not_a_subject_safe_slug_is_rejected(model: str) -> None:
    error = decode_error(task_json(model=model))
    assert "model" in str(error)
    assert "pattern" in str(error)


@pytest.mark.parametrize("task_id", ["a.b", "a b", "a*", "a>", "x" * 129])
def test_task_id_that_is_not_a_subject_token_is_rejected(task_id: str) -> None:
    error = decode_error(task_json(task_id=task_id))
    assert "task_id" in str(error)


@pytest.mark.parametrize(
    ("model", "changes"),
    [
        (cluster.NodeJoined, {"node_id": "node.1", "hostname": "h", "at": 0.0}),
        (cluster.Instance, {"instance_id": "i 1", "model": "m", "slots": 1, "created_at": 0.0,
                            "shards": []}),
        (cluster.Instance, {"instance_id": "i-1", "model": "m.x", "slots": 1, "created_at": 0.0,
                            "shards": []}),
        (tasks.CancelTask, {"task_id": "t.1"}),
    ],
)
def test_other_ids_must_be_subject_safe_too(
    model: type[BaseModel], changes: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError, match="pattern"):
        model(**changes)


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-llm", "tiny-flux2", "a", "z_9"])
def test_slug_model_ids_are_accepted(model: str) -> None:
    assert codec.decode_task(orjson.dumps(task_json(model=model))).model == model


def test_wire_messages_are_frozen() -> None:
    with pytest.raises(ValidationError):
        NATS_CLI_TASK.max_tokens = 1  # type: ignore[misc]


# ---- task ids: used exactly as sent, or refused ------------------------------------------

TASK_ID_TABLE: list[tuple[object, bool]] = [
    ("order-42", True),
    ("A_b-9", True),
    ("x", True),
    ("x" * 128, True),
    ("x" * 129, False),  # once cut to 128 and so landed on "x" * 128
    ("x" * 200, False),
    ("", False),
    ("a.b", False),  # two subject tokens
    ("a*", False),
    ("*", False),
    (">", False),
    ("fleet.>", False),
    ("a b", False),
    ("a\tb", False),
    ("abc\n", False),  # `$` in a Python regex would let a trailing newline through
    (" abc", False),
    ("é", False),
    (42, False),
    (None, False),
]


@pytest.mark.parametrize(("task_id", "valid"), TASK_ID_TABLE)
def test_is_task_id_table(task_id: object, valid: bool) -> None:
    assert tasks.is_task_id(task_id) is valid


@pytest.mark.parametrize(("task_id", "valid"), TASK_ID_TABLE)
def test_is_task_id_agrees_with_the_wire_type(task_id: object, valid: bool) -> None:
    """The pure check and the TaskId of every message accept exactly the same ids."""
    try:
        tasks.CancelTask(task_id=task_id)  # type: ignore[arg-type]
    except ValidationError:
        accepted = False
    else:
        accepted = True
    assert accepted is valid


@pytest.mark.parametrize(("task_id", "valid"), TASK_ID_TABLE)
def test_a_failed_task_carries_its_id_only_as_sent(task_id: object, valid: bool) -> None:
    """An invalid task's failure may land only on its own id, never on a shortened one."""
    error = decode_error(task_json(task_id=task_id, max_tokens=0))
    assert error.task_id == (task_id if valid else None)


@pytest.mark.parametrize("task_id", ["x" * 200, "a.b", "", 7])
def test_sent_task_id_reports_what_was_sent(task_id: object) -> None:
    data = orjson.dumps(task_json(task_id=task_id))
    assert codec.sent_task_id(data) == (task_id if isinstance(task_id, str) else None)


@FAST
@given(st.builds(
    events.TaskAccepted, **event_base, model=model_ids, node_id=ids, runner_id=ids,
    trace_id=opt(st.from_regex(r"[0-9a-f]{32}", fullmatch=True)), queue_wait_s=finite,
    delivery=counts, continued_from=counts, attempt=counts, moved_from=opt(ids),
    seed=opt(st.integers(-(2**63), 2**64 - 1)),
), st.booleans())
def test_an_accept_is_written_as_the_codec_writes_it(
    event: events.TaskAccepted, copied: bool
) -> None:
    if copied:  # a seam's accept is changed on the way (model_copy)
        event = event.model_copy(update={"attempt": 1, "moved_from": "n-2", "trace_id": None})
    assert codec.encode_accepted(event) == encode(event)

"""One valid example of every wire message; `fleet schemas` writes them to schemas/examples/."""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import BaseModel

from fleet.wire import (
    ask,
    batches,
    cluster,
    events,
    fairness,
    handoff,
    pipe,
    prefixes,
    records,
    ring,
    runners,
    tasks,
    uploads,
)

_AT = 1764495000.0
_WHEN = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
_SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

# The exact JSON the README tells a NATS CLI user to publish on fleet.tasks.smollm2-135m.
NATS_CLI_TASK = tasks.TextGeneration(
    task_id="hello-1",
    model="smollm2-135m",
    messages=[tasks.ChatMessage(role="user", content="What is the capital of France?")],
    max_tokens=32,
    temperature=0.0,
)

_CARD = cluster.ModelCard(
    id="tiny-llm", name="Tiny LLM (random weights)", tasks=["text_generation"],
    family="mlx_lm", source="built-in", n_layers=2, hidden_size=64, context_length=512,
)
_INSTANCE = cluster.Instance(
    instance_id="inst-tiny-llm-1", model="tiny-llm", created_at=_AT,
    shards=[cluster.ShardAssignment(node_id="node-a1", runner_id="run-1", end_layer=2)],
)


def examples() -> dict[str, BaseModel]:
    """File stem -> message. Stems are the messages' `type` (or `state`) tags."""
    chat = tasks.TextGeneration(
        task_id="chat-1", model="smollm2-135m", deadline=_WHEN, seed=7, stop=["\n\n"],
        messages=[
            tasks.ChatMessage(role="system", content="You answer briefly."),
            tasks.ChatMessage(role="user", content=[
                tasks.TextPart(text="What is in this picture?"), tasks.ImagePart(sha256=_SHA)
            ]),
        ],
    )
    found = {
        "nats-cli-task": NATS_CLI_TASK,
        "text_generation": chat,
        "image_generation": tasks.ImageGeneration(
            task_id="img-1", model="tiny-flux2", prompt="a red fox in snow", size="128x128",
            steps=4, seed=42, partial_images=2,
        ),
        "image_edits": tasks.ImageEdits(
            task_id="edit-1", model="tiny-flux2", prompt="make it night", size="128x128",
            input_images=[_SHA], strength=0.5,
        ),
        "embeddings": tasks.Embeddings(
            task_id="emb-1", model="tiny-embed", input=["The quick brown fox", "Hello!"],
        ),
        "embedding": events.EmbeddingChunk(
            task_id="emb-1", at=_AT, index=0, encoding_format="float", dimensions=4,
            embeddings=[[0.5, -0.5, 0.5, 0.5], [0.1, 0.7, -0.7, 0.1]], forward_pass=12,
        ),
        "image_stored": uploads.ImageStored(sha256=_SHA, size=20480, already_stored=False),
        "upload_refused": uploads.UploadRefused(
            reason="digest_mismatch", message="the image's sha256 is not the Fleet-Sha256 sent",
        ),
        "cancel_task": tasks.CancelTask(task_id="chat-1", reason="client went away"),
        "task_accepted": events.TaskAccepted(
            task_id="chat-1", at=_AT, model="smollm2-135m", node_id="node-a1", runner_id="run-1",
            trace_id="4bf92f3577b34da6a3ce929d0e0e4736", queue_wait_s=0.004,
        ),
        "token": events.TokenChunk(task_id="chat-1", at=_AT, index=0, token_id=504, text="Paris"),
        # Several tokens made close together, in one event: indexes 1, 2 and 3.
        "tokens": events.TokenChunk(
            task_id="chat-1", at=_AT, index=1, token_id=314, text=" is lovely",
            token_ids=[314, 9641, 13],
        ),
        "tool_call": events.ToolCallChunk(
            task_id="chat-1", at=_AT, index=0, id="call_1", name="get_weather",
            arguments='{"city": "Paris"}',
        ),
        "image": events.ImageChunk(
            task_id="img-1", at=_AT, sha256=_SHA, image_index=0, format="png", width=128,
            height=128, size_bytes=20480,
            stats=events.ImageStats(seconds_per_step=0.15, total_s=0.7, steps=4),
        ),
        "error": events.ErrorChunk(
            task_id="chat-1", at=_AT, reason=events.ErrorReason.CONTEXT_LENGTH,
            message="prompt of 3000 tokens exceeds the context of 2048",
        ),
        "task_finished": events.TaskFinished(
            task_id="chat-1", at=_AT, status="completed", finish_reason="stop",
            usage=events.Usage(prompt_tokens=31, completion_tokens=8, total_tokens=39),
            stats=events.TaskStats(time_to_first_token_s=0.12, tokens_per_s=16.5, total_s=0.6),
        ),
        "task_refused": events.TaskRefused(
            task_id="chat-1", model="smollm2-135m", reason="task_id_taken",
            message="task id 'chat-1' belongs to another task message", at=_AT, stream_seq=42,
        ),
        "task_fence": events.TaskFence(
            task_id="chat-1", attempt=1, node_id="node-b", delivery=2, at=_AT,
        ),
        "ask_answer": ask.AskAnswer(
            task_id="hello-1", model="smollm2-135m", status="completed", finish_reason="stop",
            text="The capital of France is Paris.",
            usage=events.Usage(prompt_tokens=36, completion_tokens=8, total_tokens=44),
        ),
        "ask_error": ask.AskError(
            task_id="hello-1", reason="task_id_taken",
            message="task id 'hello-1' belongs to another task message",
        ),
        "file_record": batches.FileRecord(
            id="file-abc", tenant="team-a", filename="requests.jsonl", purpose="batch",
            bytes=20480, created_at=1764495000,
        ),
        "batch_record": batches.BatchRecord(
            id="batch_abc", tenant="team-a", endpoint="/v1/chat/completions",
            input_file_id="file-abc", status="in_progress", created_at=1764495000,
            in_progress_at=1764495001, expires_at=1764581400,
            request_counts=batches.RequestCounts(total=100, completed=40, failed=2),
        ),
        "batch_result": batches.BatchResult(
            batch_id="batch_abc", line=7, custom_id="request-7", task_id="batch_abc-7",
            status_code=200, body={"object": "chat.completion", "choices": []},
        ),
        "batch_lease": batches.BatchLease(
            batch_id="batch_abc", owner="gw-5f2a9c", until=1764495010.0,
        ),
        "idempotency_record": batches.IdempotencyRecord(
            path="/v1/chat/completions", fingerprint="ab" * 32, seed="Xk3pQz9RfL2mYv8T",
            created_at=1764495000.0,
        ),
        "tenant_share": fairness.TenantShare(counter=1840.5, waiting=3, at=1764495000.0),
        "task_record": records.TaskRecord(
            tenant="team-a", api="chat.completions", model="smollm2-135m", created=1764495000,
            choices=["chatcmpl-x-0", "chatcmpl-x-1"], include_usage=True,
        ),
        "model_card": _CARD,
        "node_info": cluster.NodeInfo(
            node_id="node-a1", hostname="box", memory_total_bytes=24 << 30,
            memory_available_bytes=20 << 30, cpu_count=2, models_on_disk=["tiny-llm"],
            devices=[cluster.DeviceInfo(kind="cpu", name="x86_64")], started_at=_AT, at=_AT,
        ),
        "node_capabilities": cluster.NodeCapabilities(
            node_id="node-a1", hostname="box", memory_total_bytes=24 << 30,
            memory_available_bytes=20 << 30, cpu_count=2, models_on_disk=["tiny-llm"],
            models_available=["tiny-llm"], started_at=_AT,
        ),
        "capabilities_keeper": cluster.CapabilitiesKeeper(node_id="node-a1", at=_AT),
        "instance": _INSTANCE,
        "runner_record": cluster.RunnerRecord(
            runner_id="run-1", instance_id="inst-tiny-llm-1", node_id="node-a1",
            model="tiny-llm", status=runners.RunnerReady(), slots=4, at=_AT,
        ),
        "prefix_summary": prefixes.PrefixSummary(
            runner_id="run-1", node_id="node-a1", model="tiny-llm", block_chars=256,
            blocks=["9f86d081884c7d65", "2feaa0c55ad015a3"], in_flight=1, slots=4, at=_AT,
        ),
        "task_hand_off": handoff.TaskHandOff(
            from_node="node-a1", runner_id="run-2", subject="fleet.tasks.tiny-llm",
            ack_subject="$JS.ACK.FLEET_TASKS.tasks-tiny-llm.1.42.42.1764000000000000000.0",
            headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
            data='{"type":"text_generation","task_id":"hello-1","model":"tiny-llm",'
            '"messages":[{"role":"user","content":"hello"}]}',
        ),
        "hand_off_answer": handoff.HandOffAnswer(taken=True),
        "step_plan": ring.StepPlan(
            admit=[ring.PlannedAdmission(task=chat.model_copy(update={"model": "tiny-llm"}))],
            cancel=["hello-1"],
        ),
        "runner_status_changed": cluster.RunnerStatusChanged(
            runner_id="run-1", instance_id="inst-tiny-llm-1", node_id="node-a1",
            model="tiny-llm", status=runners.RunnerLoading(layers_done=1, layers_total=2), at=_AT,
        ),
        "node_joined": cluster.NodeJoined(node_id="node-a1", hostname="box", at=_AT),
        "node_left": cluster.NodeLeft(node_id="node-a1", at=_AT),
        "runner_spec": pipe.RunnerSpec(
            runner_id="run-1", instance_id="inst-tiny-llm-1", node_id="node-a1", card=_CARD,
            model_path="/data/models/tiny-llm", images_dir="/data/images",
            group=ring.GroupSpec(rank=1, start_layer=1, end_layer=2,
                                 ring=["10.0.0.1:52001", "10.0.0.2:52001"]),
        ),
        "submit_task": pipe.SubmitTask(task=NATS_CLI_TASK, traceparent=None),
        "runner_status": pipe.RunnerStatusReport(
            status=runners.RunnerFailed(error="out of memory")
        ),
    }
    return found

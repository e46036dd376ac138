"""A task message passed from the worker that pulled it to the node whose runner should run
it (`fleet.handoff.<node_id>`, a core request between workers).

The message is passed whole and stays in FLEET_TASKS: `ack_subject` is the JetStream reply
subject of the delivery the sender holds, so the receiver acknowledges, heartbeats or gives
back the very same message (same stream sequence, hence the same task-id claim, the same
delivery count for continuation and MaxDeliver). Nothing is republished, so nothing can be
stored twice; if the receiver dies, AckWait redelivers the message as it would for any
worker.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.wire.base import NodeId, RunnerId, Wire


class TaskHandOff(Wire):
    type: Literal["task_hand_off"] = "task_hand_off"
    from_node: NodeId
    runner_id: RunnerId = Field(description="the runner the sender chose on the receiving node")
    subject: str = Field(
        pattern=r"^fleet\.tasks\.[a-z0-9][a-z0-9_-]{0,63}$",
        description="the task message's subject, fleet.tasks.<model>",
    )
    ack_subject: str = Field(
        pattern=r"^\$JS\.ACK\.FLEET_TASKS\.[^ *>]+$",
        description="the JetStream reply subject of the delivery being handed over",
    )
    headers: dict[str, str] = Field(default_factory=dict)
    data: str = Field(description="the task message's body, verbatim (UTF-8 JSON)")


class HandOffAnswer(Wire):
    """The receiver's answer: taken (it holds the message now) or declined (the sender keeps
    it and runs it itself)."""

    type: Literal["hand_off_answer"] = "hand_off_answer"
    taken: bool
    reason: str = ""

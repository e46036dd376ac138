"""What a runner's prefix cache holds, as its worker advertises it (KV FLEET_PREFIXES): a whole
summary under `<model>.<runner id>` when its blocks change (at most once a second), and a load
update (`load_only`, no blocks) under `<model>.<runner id>.load` when only its load does."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.wire.base import ModelId, NodeId, RunnerId, Wire


class PrefixSummary(Wire):
    """A runner's prompt blocks, most recently used last, under its runner id; the bucket's
    TTL drops a runner whose worker stopped refreshing it."""

    type: Literal["prefix_summary"] = "prefix_summary"
    runner_id: RunnerId
    node_id: NodeId
    model: ModelId
    block_chars: int = Field(description="bytes of the canonical prompt rendering per block")
    blocks: list[str] = Field(
        default_factory=list,
        description="chained 64-bit block hashes (16 hex digits), oldest first",
    )
    in_flight: int = 0
    slots: int = Field(default=0, description="tasks it runs at once (0: not said)")
    prefilling: int = Field(default=0, description="tasks in flight with no output yet")
    prefill_blocks: int = Field(
        default=0, description="prompt blocks those tasks had to prefill (not cached there)"
    )
    spare_cores: float | None = Field(
        default=None, description="its node's idle CPU in cores, measured (null: not said)"
    )
    load_only: bool = Field(
        default=False,
        description="a load update: no blocks here, the runner's blocks are those of its last "
        "whole summary (its key without `.load`)",
    )
    at: float

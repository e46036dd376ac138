"""A tenant's standing in one (model, class) for fair sharing (fleet.gateway.fair_share)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.wire.base import Wire

# On a task message: its publisher (a gateway) charges what it serves to its tenant's entry,
# so the worker that ends it does not (fleet.worker.fair_charge charges the others).
CHARGED_HEADER = "Fleet-Fair-Charged"


class TenantShare(Wire):
    """KV FLEET_FAIRNESS, key `<model>.<class>.<tenant>`: the tenant's virtual token counter
    (tokens served over its weight, fleet.bus.fairness), its requests not yet running and those
    running, kept by compare-and-set from every gateway replica. Batch lines are charged by task id
    (`charged`, `settled`), in the same compare-and-set as the counter, so a line run again
    by the replica that took its job over is charged once."""

    type: Literal["tenant_share"] = "tenant_share"
    counter: float = Field(ge=0, description="tokens served to the tenant over its weight")
    waiting: int = Field(ge=0, description="its requests held or queued and not yet running "
                         "(no runner has accepted a task of theirs): its backlog")
    running: int = Field(
        default=0, ge=0,
        description="its requests a runner accepted that have not ended (counted by the "
        "gateways that admitted them): the slots it holds, for the reserve kept for a tenant "
        "below its weighted share of the slots (fleet.gateway.fair_slots)")
    at: float = Field(description="unix time of the last change: an entry older than the "
                      "stale limit is no longer backlogged (a gateway that died mid-request)")
    weight: float = Field(
        default=1.0, gt=0,
        description="the tenant's weight as the gateway that last changed the entry read it "
        "from its tenant records; a worker charging a task published straight on NATS "
        "divides by it")
    charged: dict[str, int] = Field(
        default_factory=dict,
        description="keyed requests (batch lines, by task id) started and not yet settled: "
        "the tokens charged at their start. A gateway that takes a batch job over and finds "
        "its line here does not charge it again; settling moves it to `settled`")
    settled: list[str] = Field(
        default_factory=list,
        description="keyed requests charged what they served whose results are not yet "
        "recorded: a takeover that runs such a line again charges it nothing. A worker marks "
        "here, by task id, a NATS-published task it charged and has not yet acked: a "
        "redelivery of it (the worker died before its ack) is not charged again")

"""A tenant's standing in one (model, class) for fair sharing (fleet.gateway.fair_share)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.wire.base import Wire


class TenantShare(Wire):
    """KV FLEET_FAIRNESS, key `<model>.<class>.<tenant>`: the tenant's virtual token counter
    (tokens served over its weight, fleet.bus.fairness) and its requests not yet ended, kept
    by compare-and-set from every gateway replica."""

    type: Literal["tenant_share"] = "tenant_share"
    counter: float = Field(ge=0, description="tokens served to the tenant over its weight")
    waiting: int = Field(ge=0, description="its requests admitted or held and not yet ended")
    at: float = Field(description="unix time of the last change: an entry older than the "
                      "stale limit is no longer backlogged (a gateway that died mid-request)")

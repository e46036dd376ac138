"""Fair tenants by slots: the last free slots of a (model, class) are kept for a tenant that
holds fewer than its weighted share of them, so its next request starts at once instead of
queueing behind a tenant that holds more (fleet.gateway.fair_share applies it at admission).

The counters (fleet.bus.fairness) order the tenants by tokens served, but while a tenant
ahead holds every slot, the next request of a tenant served less still waits for a slot to
free: at 16 slots of ~1 s, one every ~60 ms. In the queue bench that wait was all of B's extra
time to a first token beside A (B 143 ms beside A, 64 ms alone; its queue stage 66 ms against
5 ms). As batch work leaves a slot to the classes above it (fleet.worker.priority), a tenant
that holds its share of the slots or more (`entitled`: slots x its weight over the present
tenants' weights, rounded down) does not take one of the last RESERVE free slots while another
present tenant holds fewer than its own share; that tenant's next request finds a slot free.
Nobody is held while slots beyond the reserve are free (work-conserving but for the reserve).

A tenant holds the slots of its requests running (TenantShare.running, every replica's) and
of those this replica published that no runner has accepted yet. The slots are the model's
instances' (FLEET_INSTANCES). Tasks of other classes and of NATS publishers are not counted:
the reserve may then be short, never larger.

Pure: tested with tables.
"""

from __future__ import annotations

from collections.abc import Mapping

RESERVE = 1  # free slots a tenant at or over its share leaves to one below it


def entitled(slots: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Each present tenant's share of the slots, by weight, rounded down (pure)."""
    total = sum(weights.values())
    if total <= 0:
        return dict.fromkeys(weights, 0)
    return {t: int(slots * w / total + 1e-9) for t, w in weights.items()}


def kept_for(held: Mapping[str, int], weights: Mapping[str, float], tenant: str, slots: int,
             reserve: int = RESERVE) -> str | None:
    """The present tenant the last free slots are kept for, so `tenant`'s next request must
    not take one (pure); None to let it. `held`: the slots each present tenant holds (`tenant`
    among them), `weights`: theirs, `slots`: the (model, class)'s, 0 when not known."""
    if slots <= 0 or slots - sum(held.values()) > reserve:
        return None
    share = entitled(slots, {t: weights.get(t, 1.0) for t in held})
    if held.get(tenant, 0) < share.get(tenant, 0):
        return None
    below = sorted(t for t in held if t != tenant and held[t] < share[t])
    return below[0] if below else None

"""Fair tenants by slots: the last free slots of a (model, class) are kept for a tenant that
holds fewer than its weighted share of them, so its next request starts at once instead of
queueing behind a tenant that holds more (fleet.gateway.fair_share applies it at admission).

The counters (fleet.bus.fairness) order the tenants by tokens served, but while a tenant
ahead holds every slot, the next request of a tenant served less still waits for a slot to
free: at 16 slots of ~1 s, one every ~60 ms. In the queue bench that wait was all of B's extra
time to a first token beside A (B 143 ms beside A, 64 ms alone; its queue stage 66 ms against
5 ms). As batch work leaves a slot to the classes above it (fleet.worker.priority), a tenant
that holds its share of the slots or more (`entitled`: slots x its weight over the present
tenants' weights, in whole slots) does not take one of the last RESERVE free slots while
another present tenant holds no more than its own share; that tenant's next request finds a
slot free.
Nobody is held while slots beyond the reserve are free (work-conserving but for the reserve).

A tenant holds the slots of its requests running (TenantShare.running, every replica's) and
of those this replica published that no runner has accepted yet. The slots are the model's
instances' (FLEET_INSTANCES). Tasks of other classes and of NATS publishers are not counted:
the reserve may then be short, never larger. A gateway that dies with requests running leaves
them counted in their tenant's entry until it goes stale (STALE_S without a change), as it
leaves `waiting`: that tenant meanwhile gets up to that many slots fewer while others are
present, never more.

Pure: tested with tables.
"""

from __future__ import annotations

from collections.abc import Mapping

RESERVE = 1  # free slots a tenant at or over its share leaves to one below it


def entitled(slots: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Each present tenant's share of the slots by weight, whole slots summing to `slots`
    (pure): rounded down, then the slots left one each to the largest remainders (ties by
    name), so no slot is nobody's (16 at 1:2 is 5 and 11, not 5 and 10 with one idle)."""
    total = sum(weights.values())
    if total <= 0:
        return dict.fromkeys(weights, 0)
    exact = {t: slots * w / total for t, w in weights.items()}
    share = {t: int(x + 1e-9) for t, x in exact.items()}
    left = slots - sum(share.values())
    for t in sorted(exact, key=lambda t: (share[t] - exact[t], t))[:max(0, left)]:
        share[t] += 1
    return share


def kept_for(held: Mapping[str, int], weights: Mapping[str, float], tenant: str, slots: int,
             reserve: int = RESERVE) -> str | None:
    """The present tenant the last free slots are kept for, so `tenant`'s next request must
    not take one (pure); None to let it. `held`: the slots each present tenant holds (`tenant`
    among them), `weights`: theirs, `slots`: the (model, class)'s, 0 when not known. Kept for
    a tenant at its share too, not only below it: its next request (one of its own ends, and
    its client asks again) needs the slot that ending frees, and another tenant's request
    admitted meanwhile would queue ahead of it in the broker and take that slot."""
    if slots <= 0 or slots - sum(held.values()) > reserve:
        return None
    share = entitled(slots, {t: weights.get(t, 1.0) for t in held})
    if held.get(tenant, 0) < share.get(tenant, 0):
        return None
    kept = sorted(t for t in held if t != tenant and share[t] > 0 and held[t] <= share[t])
    return kept[0] if kept else None

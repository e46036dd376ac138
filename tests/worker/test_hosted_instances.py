"""Which instances a worker hosts, read again only when the instance table is a new object
(fleet.worker.state.WorkerState.hosted_instances: every change of the table is a new dict)."""

from __future__ import annotations

from dataclasses import replace

from fleet.wire.cluster import Instance, ShardAssignment
from fleet.worker.state import InstancesChanged, WorkerState, apply


def instance(instance_id: str, node: str) -> Instance:
    return Instance(instance_id=instance_id, model="m", slots=1, created_at=0.0,
                    shards=[ShardAssignment(node_id=node, runner_id="pending")])


def test_a_new_table_and_another_node_are_read_afresh() -> None:
    here = WorkerState(node_id="a", instances={"i": instance("i", "a"), "j": instance("j", "b")})
    assert [i.instance_id for i in here.hosted_instances()] == ["i"]
    assert [i.instance_id for i in here.hosted_instances()] == ["i"]  # the same table
    there = replace(here, node_id="b")  # the same table, another node
    assert [i.instance_id for i in there.hosted_instances()] == ["j"]
    moved = apply(here, InstancesChanged({"i": instance("i", "b"), "j": instance("j", "b")}))
    assert moved.hosted_instances() == ()
    assert moved.hosted_layouts() == {} and moved.hosted_models() == frozenset()
    assert [i.instance_id for i in here.hosted_instances()] == ["i"]  # the old table still

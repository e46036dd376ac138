"""The worker's planner at 64 waiting tasks, thread CPU (issue 23): `python -m bench.plan_passes
CHECKOUT [CHECKOUT ...]`, each checkout timed in a process of its own, alternated.

One runner of 64 slots. A drive: 64 waiting tasks dispatched into 64 free slots, a plan a
dispatch (as Worker._drive plans). A slot freed under batches: 64 in flight and 64 waiting, a
task ends, its slot's dispatch and the plans around it. Arrival times are distinct, as intakes
give them. A batch's cycle, as `fleet up`'s loop sees one under batches of max_tokens-1 tasks
(most dispatches find 0-31 waiting): 64 in flight, 32 waiting, 16 being taken in; 16 tasks
end (first output, end, release), 16 intakes answer (queued), 16 more start, then one drive
dispatches 16; its cost a task, all of it and the planner's part (all less the same events
applied without planning). Thread CPU, min of 25 repeats: steadier than wall time on a loaded
machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
import timeit
from collections.abc import Callable

ROUNDS = 3
CYCLES = 8  # batch cycles timed in a row


def measure(checkout: str) -> str:
    sys.path.insert(0, checkout)
    from fleet.wire.cluster import Instance, ShardAssignment
    from fleet.wire.runners import RunnerReady
    from fleet.wire.tasks import TextGeneration
    from fleet.worker import plan as rules
    from fleet.worker import state as ev
    from fleet.worker.state import PendingTask, RunnerView, WorkerState, apply

    model = "fault-llm"
    instance = Instance(instance_id="i1", model=model, created_at=1.0, shards=[
        ShardAssignment(runner_id="r1", node_id="n", rank=0, start_layer=0, end_layer=1)])
    runner = RunnerView("r1", "i1", model, status=RunnerReady(), slots=64,
                        command_sent="warm_up")
    state = WorkerState(node_id="n", instances={"i1": instance}, runners={"r1": runner},
                        pulling=frozenset({model}))
    now = time.time()

    def queued(i: int) -> ev.TaskQueued:
        task = TextGeneration(task_id=f"t{i}", model=model, prompt="hi", max_tokens=1)
        return ev.TaskQueued(PendingTask(task, now + i * 1e-4, inputs={}))

    for i in range(64):
        state = apply(state, queued(i))
    waiting = state
    for i in range(64):
        state = apply(state, ev.TaskDispatched(f"t{i}", "r1"))
    for i in range(64, 128):
        state = apply(state, queued(i))
    one_free = apply(state, ev.TaskEnded("t0"))

    def drive() -> None:
        st, chain = waiting, rules.RULES
        while (action := rules.plan(st, now, chain)) is not None:
            assert isinstance(action, rules.Dispatch)
            st = apply(st, ev.TaskDispatched(action.task_id, action.runner_id))
            chain = rules.AFTER_DISPATCH

    def slot_freed() -> None:
        action = rules.plan(one_free, now)
        assert isinstance(action, rules.Dispatch)
        st = apply(one_free, ev.TaskDispatched(action.task_id, action.runner_id))
        assert rules.plan(st, now, rules.AFTER_DISPATCH) is None
        rules.plan(apply(st, ev.TaskEnded(action.task_id)), now)

    # A batch's cycle (see the docstring), CYCLES of them from one state, ids fresh each.
    # t0-t63 in flight, t64-t95 waiting, k96-k111 being taken in (they become t96-t111).
    cycle_start = waiting
    for i in range(64, 96):
        cycle_start = apply(cycle_start, queued(i))
    for i in range(64):
        cycle_start = apply(cycle_start, ev.TaskDispatched(f"t{i}", "r1"))
    for i in range(96, 112):
        cycle_start = apply(cycle_start, ev.IntakeStarted(f"k{i}", model, now))
    assert (len(cycle_start.pending), len(cycle_start.receiving),
            len(cycle_start.runners["r1"].in_flight)) == (32, 16, 64)

    def cycle_events(c: int) -> list[object]:
        """The events of cycle c before its drive: 16 end, 16 queued, 16 intakes begin."""
        events: list[object] = []
        for i in range(16 * c, 16 * c + 16):
            task_id = f"t{i}"
            events += [ev.FirstOutput(task_id, "r1"), ev.TaskEnded(task_id),
                       ev.TaskReleased(task_id)]
        for i in range(96 + 16 * c, 112 + 16 * c):
            events += [ev.IntakeEnded(f"k{i}"), queued(i)]
        events += [ev.IntakeStarted(f"k{i}", model, now) for i in range(112 + 16 * c,
                                                                        128 + 16 * c)]
        return events

    cycles = [cycle_events(c) for c in range(CYCLES)]
    dispatched: list[list[ev.TaskDispatched]] = []

    def batches(record: bool = False) -> None:
        st = cycle_start
        for events in cycles:
            for event in events:
                st = apply(st, event)
            chain, sent = rules.RULES, []
            while (action := rules.plan(st, now, chain)) is not None:
                assert isinstance(action, rules.Dispatch)
                event = ev.TaskDispatched(action.task_id, action.runner_id)
                st = apply(st, event)
                sent.append(event)
                chain = rules.AFTER_DISPATCH
            if record:
                dispatched.append(sent)
            assert len(sent) == 16, len(sent)

    batches(record=True)

    def batches_unplanned() -> None:
        st = cycle_start
        for events, sent in zip(cycles, dispatched, strict=True):
            for event in events + sent:
                st = apply(st, event)

    def best(call: Callable[[], object], number: int) -> float:
        times = timeit.repeat(call, number=number, repeat=25, timer=time.thread_time)
        return min(times) / number * 1e6

    cycle = best(batches, 3) / (16 * CYCLES)
    applied = best(batches_unplanned, 3) / (16 * CYCLES)
    return (f"{checkout}: drive {best(drive, 3) / 64:.1f} us a task | slot freed (plan, "
            f"dispatch, plan, end, plan) {best(slot_freed, 100):.1f} us | a plan with a slot "
            f"free {best(lambda: rules.plan(one_free, now), 200):.1f} us | batch cycles "
            f"{cycle:.1f} us a task, of which planning {cycle - applied:.1f}, applying "
            f"{applied:.1f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(measure(sys.argv[2]))
        return
    for _ in range(ROUNDS):
        for checkout in sys.argv[1:]:
            subprocess.run([sys.executable, "-m", "bench.plan_passes", "--one", checkout],
                           check=True)


if __name__ == "__main__":
    main()

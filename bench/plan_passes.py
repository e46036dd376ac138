"""The worker's planner at 64 waiting tasks, thread CPU (issue 23): `python -m bench.plan_passes
CHECKOUT [CHECKOUT ...]`, each checkout timed in a process of its own, alternated.

One runner of 64 slots. A drive: 64 waiting tasks dispatched into 64 free slots, a plan a
dispatch (as Worker._drive plans). A slot freed under batches: 64 in flight and 64 waiting, a
task ends, its slot's dispatch and the plans around it. Arrival times are distinct, as intakes
give them. Thread CPU, min of 25 repeats: steadier than wall time on a loaded machine.
"""

from __future__ import annotations

import subprocess
import sys
import time
import timeit
from collections.abc import Callable

ROUNDS = 3


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

    def best(call: Callable[[], object], number: int) -> float:
        times = timeit.repeat(call, number=number, repeat=25, timer=time.thread_time)
        return min(times) / number * 1e6

    return (f"{checkout}: drive {best(drive, 3) / 64:.1f} us a task | slot freed (plan, "
            f"dispatch, plan, end, plan) {best(slot_freed, 100):.1f} us | a plan with a slot "
            f"free {best(lambda: rules.plan(one_free, now), 200):.1f} us")


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

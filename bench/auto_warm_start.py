"""What auto's first trial costs a run: ``compression="auto"`` from scratch
("cold") against auto started from the decisions of an earlier run of the
same job ("warm": its AutoPlanner state after STEPS steps, loaded before the
first step without its guard, trial or step counts, so the planned buckets
skip the first trial and re-check AUTO_SETTLE steps in, as a resumed run
does), in turns REPS times on TASK with OPTIM; printed, each kind's mean ms a
step in segments of steps. Run once per rank under torch.distributed's
env:// variables (bench/README "Where the rest of a step goes on the Intel
Xeon"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/auto_warm_start.py classify sgd 300 4
"""
import copy
import sys

import torch
import torch.distributed as dist

from hetcomm.autotrial import AUTO_SETTLE
from hetcomm.benchmarks import common, tasks, train

SEGMENTS = ((1, 20), (20, 40), (40, 100), (100, 160), (160, 300))


def one_run(task_name: str, optim: str, steps: int, rank: int, decisions=None):
    """(step seconds, HookState) of one auto run, started from ``decisions`` (an AutoPlanner state) if given."""
    task = tasks.TASKS[task_name]()
    _, ddp, opt, state, _ = train.setup(task, "auto", optim, steps, rank)
    if decisions is not None:
        state._planner.auto.load_state_dict(copy.deepcopy(decisions))
    return common.timed_steps(ddp, opt, task, rank, steps), state


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_flush_denormal(True)  # as every run of hetcomm bench train (common.denormals_flushed)
    rank = dist.get_rank()
    task_name, optim, steps, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    _, first = one_run(task_name, optim, steps, rank)
    decisions = first._planner.auto.state_dict()
    for part in ("guard", "trial"):  # this run's own: the guard reads its gradients, no trial is running
        decisions.pop(part, None)
    decisions.update(compressed_steps=0, next_check=AUTO_SETTLE, rechecks=0, confirms=0, confirm_at=None,
                     lowrank_asks=False)
    if rank == 0:
        print("decisions:", {k: decisions[k] for k in ("decided", "round_times", "order")})
    times = {"cold": [], "warm": []}
    for r in range(reps):
        for kind in (("cold", "warm") if r % 2 == 0 else ("warm", "cold")):
            t, state = one_run(task_name, optim, steps, rank, None if kind == "cold" else decisions)
            times[kind].append(t)
            if rank == 0:
                plans = {k: (p["mode"], p["algorithm"]) for k, p in state.stats()["plans"].items()}
                print(kind, "re-checks", state._planner.auto.rechecks, "plans", plans)
    if rank == 0:
        for kind, runs in times.items():
            print(kind, "ms a step:", common.segment_ms(runs, SEGMENTS))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

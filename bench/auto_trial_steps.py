"""auto's trial steps against the same plans' steps outside a trial: each
step's time (steps 40 on) by the plans it ran and whether a trial ran it, and
a trial's steps by the plans of the step before, over RUNS runs of STEPS steps
with a re-check every RECHECK compressed steps (AUTO_SETTLE and AUTO_RECHECK
set to it, so a run has many), run once per rank under torch.distributed's
env:// variables (bench/README
"lowrank's rounds, fixed for a run; a re-check's steps after a switch"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/auto_trial_steps.py classify sgd 600 30 4      (TASK OPTIMIZER STEPS RECHECK RUNS)
"""
import collections
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import hetcomm
from hetcomm import autoplan
from hetcomm.benchmarks import tasks, train


def _row(label: str, v: list) -> str:
    return f"{label} n={len(v):4d} mean {1000 * statistics.mean(v):.2f} median {1000 * statistics.median(v):.2f} ms"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task_name, optim, steps, recheck, runs = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    autoplan.AUTO_RECHECK = autoplan.AUTO_SETTLE = recheck
    by_plan, by_before = collections.defaultdict(list), collections.defaultdict(list)
    for run in range(runs):
        task = tasks.TASKS[task_name]()
        torch.manual_seed(run)
        ddp = nn.parallel.DistributedDataParallel(task.model())
        opt = train.make_optimizer(optim, ddp.parameters(), train.task_lr(task, optim))
        state = hetcomm.HookState("auto")
        ddp.register_comm_hook(state, hetcomm.hook)
        auto, before = state._planner.auto, None
        for step in range(steps):
            x, y = task.batch_for(step, rank)
            trial = auto.trial_start is not None
            t = time.perf_counter()
            opt.zero_grad()
            task.loss(ddp(x), y).backward()
            opt.step()
            secs = time.perf_counter() - t
            trial = trial or auto.trial_start is not None
            plans = "+".join(sorted({f"{p.mode}/{p.algorithm}" for p in state.last_plans.values()}))
            if step >= 40:
                by_plan[(plans, trial)].append(secs)
                if trial:
                    by_before[(plans, before)].append(secs)
            before = plans
        if rank == 0:
            print(f"run {run} ends on", {k: (p.mode, p.algorithm) for k, p in state.last_plans.items()}, flush=True)
        state.close()
    if rank == 0:
        for (plans, trial), v in sorted(by_plan.items()):
            print(_row(f"{plans:40s} {'trial ' if trial else 'steady'}", v))
        print("trial steps by the plans of the step before:")
        for (plans, before), v in sorted(by_before.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            print(_row(f"  {plans:36s} after {str(before):36s}", v))
    dist.destroy_process_group()

"""A run's steps grouped by what each step's buckets ran: for TASK (a task of
``hetcomm bench train``) under MODE (a mode of ``bench train``, registered as
``bench train`` registers it: an attached optimizer warms up for a fifth of
STEPS) with OPTIM (adamw by default; sgd: SGD-momentum), the median and mean
ms of the steps from step 5 on, per set of (mode, algorithm, why) of the
step's plans (an attached Adam's exact steps, the warm-up's, the compressed
ones). Run once per rank under torch.distributed's env:// variables
(bench/README "An attached Adam's exact steps over the hierarchy"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/steps_by_plan.py classify onebit+m 400 [OPTIM]
"""
import statistics
import sys
import time

import torch.distributed as dist

from hetcomm.benchmarks import tasks, train

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task_name, mode_name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    optim = sys.argv[4] if len(sys.argv) > 4 else "adamw"
    task = tasks.TASKS[task_name]()
    _, ddp, opt, state, _ = train.setup(task, mode_name, optim, steps, rank)
    by_plan = {}
    for step in range(steps):
        x, y = task.batch_for(step, rank)
        t0 = time.perf_counter()
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        opt.step()
        ms = (time.perf_counter() - t0) * 1e3
        if step >= 5 and state is not None:
            plans = tuple(sorted({f"{p.mode}/{p.algorithm}/{p.why}" for p in state.last_plans.values()}))
            by_plan.setdefault(plans, []).append(ms)
    if rank == 0:
        for plans, ms in sorted(by_plan.items(), key=lambda kv: -len(kv[1])):
            print(f"{len(ms):4d} steps  median {statistics.median(ms):6.1f} ms  mean {statistics.mean(ms):6.1f}  "
                  f"{', '.join(plans)}")
    if state is not None:
        state.close()
    dist.destroy_process_group()

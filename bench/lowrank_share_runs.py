"""What `HookState.stats()["lowrank_share"]` reads along `hetcomm bench
train`'s tasks: lowrank at a given rank, 2 loopback ranks, SGD-momentum at
fp32's rate, DDP's default buckets, 401 steps (the windows' readings: steps
40, 120, 220; before 2026-11-28's windows, single readings at 100, 200, 400).

    python bench/lowrank_share_runs.py lm:4 lm:16 wide:4 classify:4 regress:4
"""
import sys

from torch import nn

import hetcomm
from hetcomm.benchmarks import tasks, train
from hetcomm.launch import spawn_ranks


def body(rank, world, name, r, steps):
    task = tasks.TASKS[name]()
    model = task.model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = train.make_optimizer("sgd", ddp.parameters(), train.task_lr(task, "sgd"))
    state = hetcomm.HookState("lowrank", matrix_approximation_rank=r)
    ddp.register_comm_hook(state, hetcomm.hook)
    reads = []
    for step in range(steps):
        x, y = task.batch_for(step, rank)
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        opt.step()
        now = state.stats().get("lowrank_share")
        if now and (not reads or reads[-1] != now):
            reads.append(now)
    final = task.evaluate(model)
    state.close()
    return reads, final


if __name__ == "__main__":
    for case in sys.argv[1:]:
        name, r = case.split(":")
        reads, final = spawn_ranks(body, 2, name, int(r), 401, timeout=1200)[0]
        print(name, "rank", r, [(x["step"], round(x["share"], 3)) for x in reads], final)

"""lowrank's rounds a step fixed for a whole run (no trial): auto (or MODE)
on the wide model, RUNS runs of STEPS steps, pipelined and together in turns
A B B A (seeds in pairs), mean ms of steps 40 on, run once per rank under
torch.distributed's env:// variables (bench/README
"lowrank's rounds, fixed for a run; a re-check's steps after a switch"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/lowrank_rounds_fixed.py 8 200 sgd auto      (RUNS STEPS OPTIMIZER MODE)
"""
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

import hetcomm
from hetcomm.benchmarks import common, tasks, train
from hetcomm.lowrank_rounds import AGAIN

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs, steps, optim, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    means = {"pipelined": [], "together": []}
    for run in range(runs):
        arm = ("pipelined", "together")[run % 4 in (1, 2)]
        task = tasks.TASKS["wide"]()
        torch.manual_seed(run // 2)
        ddp = nn.parallel.DistributedDataParallel(task.model())
        opt = train.make_optimizer(optim, ddp.parameters(), train.task_lr(task, optim))
        state = hetcomm.HookState(mode)
        state._rounds.choice, state._rounds.again = arm, AGAIN  # decided, no window left to open: no trial
        ddp.register_comm_hook(state, hetcomm.hook)
        times = common.timed_steps(ddp, opt, task, rank, steps)
        means[arm].append(1000 * statistics.mean(times[40:]))
        if rank == 0:
            print(f"run {run} {arm}: steps 40-{steps} {means[arm][-1]:.1f} ms; each 20:",
                  [round(1000 * statistics.mean(times[n:n + 20]), 1) for n in range(0, steps, 20)],
                  {k: (p["mode"], p["algorithm"]) for k, p in state.stats()["plans"].items()},
                  state.stats()["lowrank_rounds"], flush=True)
        state.close()
    if rank == 0:
        print({k: [round(v, 1) for v in vs] for k, vs in means.items()},
              {k: round(statistics.mean(vs), 2) for k, vs in means.items() if vs})
    dist.destroy_process_group()

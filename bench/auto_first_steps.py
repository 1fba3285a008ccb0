"""auto's first steps on the wide model (or another task of ``hetcomm bench
train``), each step's time and rank 0's INFO log (the trial's rounds, the
guard's reading), run once per rank under torch.distributed's env:// variables
(bench/README "The first reading at step 30, and a trial without what cannot
win"; "Digits' best mode on the Intel Xeon"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit -- python bench/auto_first_steps.py 40
    ... -- python bench/auto_first_steps.py 40 2     (start_iter 2: the trial from step 2, auto's default before)
    ... -- python bench/auto_first_steps.py 200 - classify adamw    (STEPS START_ITER TASK OPTIMIZER; - : the default)
    ... -- python bench/auto_first_steps.py 200 - classify sgd int3  (a fixed mode's steps beside auto's: MODE last)
    LINK_SPAN=2.0 hetcomm testbed ... -- python bench/auto_first_steps.py 30 - rnn adamw
        (hetcomm.autotrial.AUTO_LINK_SPAN for this run: 2.0 leaves fp32's round out of the first trial as a codec
        round's, by 2x the fastest round measured so far, as before 2026-12-05)
"""
import logging
import os
import sys

import torch.distributed as dist
from torch import nn

import hetcomm
from hetcomm import autotrial
from hetcomm.benchmarks import common, tasks, train

if __name__ == "__main__":
    autotrial.AUTO_LINK_SPAN = float(os.environ.get("LINK_SPAN", autotrial.AUTO_LINK_SPAN))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    args = sys.argv[1:] + [None] * 5
    steps = int(args[0] or 40)
    start_iter = None if args[1] in (None, "-") else int(args[1])
    task, optim = tasks.TASKS[args[2] or "wide"](), args[3] or "sgd"
    model = task.model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = train.make_optimizer(optim, ddp.parameters(), train.task_lr(task, optim))
    state = hetcomm.HookState(args[4] or "auto", start_iter=start_iter)
    ddp.register_comm_hook(state, hetcomm.hook)
    times = common.timed_steps(ddp, opt, task, rank, steps)
    if rank == 0:
        print("step ms:", " ".join(f"{1000 * t:.0f}" for t in times))
        print("cumulative s at 10/20/30/40:", [round(sum(times[:n]), 2) for n in (10, 20, 30, 40)])
        print("ms a step, each 10 steps:", [round(1000 * sum(times[n:n + 10]) / len(times[n:n + 10]), 1)
                                            for n in range(0, len(times), 10)])
        plans = {k: (p["mode"], p["algorithm"]) for k, p in state.stats()["plans"].items()}
        auto = state.stats().get("auto") or {}
        print("plans", plans, "guard", auto.get("lowrank_guard"))
        for key, b in (auto.get("buckets") or {}).items():  # each candidate's predicted ms, and its measured
            print("candidates", key[:24], [(c["mode"], c["algorithm"], c.get("predicted_s") and
                                            round(1000 * c["predicted_s"], 1)) for c in b["candidates"]])
    state.close()
    dist.destroy_process_group()

"""What auto's rule ``AUTO_DROP_SLOWER`` saves a run: ``compression="auto"``
with it ("drop": after a trial's first cycle the rounds no faster than the
round the decision keeps run no more, since they cannot replace it) and
without it ("keep": every round within AUTO_SPAN of the fastest runs
AUTO_REPEATS steps), in turns REPS times on TASK with OPTIM for STEPS steps;
printed, each kind's mean ms a step in SEGMENTS (``A-B,C-D,...``), its mean
time of a whole run and the plans each run ended on. Run once per rank under
torch.distributed's env:// variables (bench/README "A trial's rounds that
cannot win"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/auto_drop_slower.py classify sgd 300 10 1-20,20-40,40-100,100-160,160-300
"""
import statistics
import sys

import torch
import torch.distributed as dist

from hetcomm import autotrial
from hetcomm.benchmarks import common, tasks, train


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_flush_denormal(True)  # as every run of hetcomm bench train (common.denormals_flushed)
    rank = dist.get_rank()
    task_name, optim, steps, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    segments = [tuple(int(x) for x in s.split("-")) for s in sys.argv[5].split(",")]
    times = {True: [], False: []}
    ends = {True: [], False: []}
    for r in range(reps):
        for drop in ((True, False) if r % 2 == 0 else (False, True)):
            autotrial.AUTO_DROP_SLOWER = drop
            task = tasks.TASKS[task_name]()
            _, ddp, opt, state, _ = train.setup(task, "auto", optim, steps, rank)
            times[drop].append(common.timed_steps(ddp, opt, task, rank, steps))
            ends[drop].append("+".join(p["mode"] for p in state.stats()["plans"].values()))
            state.close()
    if rank == 0:
        for drop, runs in times.items():
            print("drop" if drop else "keep", "ms a step:", common.segment_ms(runs, segments),
                  f" a run: {1000 * statistics.mean(sum(t) for t in runs):.1f} ms;", "ended on:", ends[drop])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""DDP bucket layouts side by side in one launch: for TASK (a task of
``hetcomm bench train``) under MODE (a mode of ``bench train``, its hook as
``bench train`` makes it) and OPTIM (sgd: SGD-momentum; adamw), a fresh DDP
model for each ``bucket_cap_mb`` of CAPS ("-": DDP's default, a first bucket
of 1 MB) runs STEPS steps, REPS times, the layouts taking turns (ABBA...), so a
machine whose speed drifts from one minute to the next weighs on each alike,
after one run of the first layout that is not counted (a launch's first run
is its slowest: PowerSGD's hook, one bucket whatever the cap, read 50.9 and
48.3 ms as "default" against 47.0 and 46.4 without it).
Printed on rank 0: each run's mean and median step (ms, steps SKIP.. ) and
the step's buckets, then each layout's mean of the runs' means. ``--device
cuda`` (last; "cpu" by default) puts each rank's model and batches on
the GPU of its LOCAL_RANK (ranks share GPUs where there are fewer; NCCL with
a GPU per rank, gloo otherwise, as ``bench train --device cuda``), each step
timed to the GPU's end. Run once per rank under torch.distributed's env://
variables (bench/README "A model in one bucket: DDP's bucket_cap_mb"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit --sched batch -- \\
        python bench/bucket_layouts.py rnn int3 adamw 150 30 6 -,0.5 [--device cuda]
"""
import statistics
import sys
import time
from typing import List, Optional

import torch.distributed as dist

from hetcomm.benchmarks import common, tasks, train


def one_run(task_name: str, mode_name: str, optim: str, steps: int, cap: Optional[float], rank: int,
            device: str):
    """(step times in s, buckets of the last step) of a fresh model in the layout ``cap`` makes."""
    task = tasks.TASKS[task_name]()
    dev = common.rank_device(rank, device)
    _, ddp, opt, state, _ = train.setup(task, mode_name, optim, steps, rank, device, cap)  # PowerSGD: one bucket
    dist.barrier()
    times = []
    for step in range(steps):
        x, y = (t.to(dev) for t in task.batch_for(step, rank))
        t0 = time.perf_counter()
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        opt.step()
        common.sync(dev)  # a GPU's step counts when it is done
        times.append(time.perf_counter() - t0)
    buckets = len(state.last_plans) if state is not None else None
    if state is not None:
        state.close()
    return times, buckets


def main(task_name: str, mode_name: str, optim: str, steps: int, skip: int, reps: int, caps: List[Optional[float]],
         device: str = "cpu"):
    common.require_device(device, "bucket_layouts.py")
    dist.init_process_group(common.backend_for(device, 1))
    rank = dist.get_rank()
    means = {cap: [] for cap in caps}
    one_run(task_name, mode_name, optim, steps, caps[0], rank, device)  # not counted
    for rep in range(reps):
        for cap in caps if rep % 2 == 0 else caps[::-1]:
            times, buckets = one_run(task_name, mode_name, optim, steps, cap, rank, device)
            kept = times[skip:]
            means[cap].append(statistics.mean(kept) * 1e3)
            if rank == 0:
                label = "default" if cap is None else f"{cap:g} MB"
                print(f"run {rep} bucket_cap_mb {label:8s} mean {means[cap][-1]:6.1f} ms  median "
                      f"{statistics.median(kept) * 1e3:6.1f} ms  buckets {buckets if buckets is not None else '-'}",
                      flush=True)
    if rank == 0:
        print(f"{task_name} {mode_name} {optim} on {device}: mean of the runs' mean steps (ms), steps {skip}-{steps - 1}")
        for cap, m in means.items():
            label = "default" if cap is None else f"{cap:g} MB"
            print(f"  {label:8s} {statistics.mean(m):6.1f}   ({' '.join(f'{v:.1f}' for v in m)})")
    dist.destroy_process_group()


if __name__ == "__main__":
    a = sys.argv[1:]
    device = "cpu"
    if "--device" in a:
        device = a[a.index("--device") + 1]
        a = a[:a.index("--device")]
    main(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5]), [None if c == "-" else float(c) for c in a[6].split(",")],
         device)

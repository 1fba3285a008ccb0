"""ATen ops a step on each thread of rank 0: MODE (a mode of `hetcomm bench
train`, its hook as `bench train` makes it) on TASK's model with
SGD-momentum, steps 100 .. 100 + STEPS under torch's profiler with
``profile_all_threads`` (hetcomm's comm thread and gloo's included); per
thread the ops a step and the most frequent, then the most frequent ops
over all threads with their self CPU time a step (the profiler's own cost
included: counts, not timings, are what it is for). Run once per rank
under torch.distributed's env:// variables (bench/README "lowrank's views
of its buffers in one op"):

    torchrun --nproc-per-node 2 bench/op_counts.py lowrank-r4 50 classify
"""
import sys
from collections import Counter, defaultdict

import torch.distributed as dist
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from hetcomm.benchmarks import tasks, train

WARM = 100  # steps before the profiled ones (lowrank's rounds chosen, auto's first trial over)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "lowrank-r4"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    task_name = sys.argv[3] if len(sys.argv) > 3 else "classify"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task = tasks.TASKS[task_name]()
    _, ddp, opt, _, _ = train.setup(task, mode, "sgd", WARM + steps, rank)

    def step(i: int) -> None:
        x, y = task.batch_for(i, rank)
        opt.zero_grad(set_to_none=True)
        task.loss(ddp(x), y).backward()
        opt.step()

    for i in range(WARM):
        step(i)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        for i in range(WARM, WARM + steps):
            step(i)
    dist.barrier()
    if rank == 0:
        by_thread = defaultdict(Counter)
        for ev in prof.events():
            by_thread[ev.thread][ev.name] += 1
        print(f"{mode} on {task_name}, steps {WARM}-{WARM + steps - 1}, rank 0: ATen ops a step")
        for thread, counts in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
            top = ", ".join(f"{name} {n / steps:.1f}" for name, n in counts.most_common(10))
            print(f"thread {thread}: {sum(counts.values()) / steps:.0f} a step; {top}")
        for ev in sorted(prof.key_averages(), key=lambda e: -e.count)[:20]:
            print(f"  {ev.key:50s} {ev.count / steps:7.1f} a step, self {ev.self_cpu_time_total / steps:7.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

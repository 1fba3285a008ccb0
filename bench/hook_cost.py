"""The comm hook's own CPU a bucket on DDP's thread: for each MODE (a mode of
`hetcomm bench train` without an attached optimizer, its hook as `bench
train` makes it; ``trivial``, a hook that hands the bucket back unreduced:
DDP's own cost of calling a Python hook), the CPU time of the thread inside
the hook call (``time.thread_time``: a core taken by another thread does not
count), per bucket over steps 40 on, TASK's model (SGD-momentum) in DDP
buckets of BUCKET_MB (PowerSGD's hook in one, as `bench train` runs it: on
gloo it fails or hangs with several in torch 2.13), the modes in turns REPS times; printed,
the median over the runs of each run's mean. That time is taken from the
backward pass (on a GPU, from launching its kernels). Run once per rank under
torch.distributed's env:// variables (bench/README "The hook's own CPU a
bucket"):

    chrt --batch 0 torchrun --nproc-per-node 2 bench/hook_cost.py lm 0.1 240 3 trivial,torch-allreduce,none,int3,auto
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from hetcomm import modes
from hetcomm.benchmarks import tasks, train


def _trivial(_, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def one_run(task_name: str, bucket_mb: float, steps: int, mode: str, rank: int):
    """(the hook's CPU s a bucket over steps 40 on, buckets a step) of one run."""
    task = tasks.TASKS[task_name]()
    torch.manual_seed(0)
    if mode == "trivial":
        options, (hook_state, inner, state) = {"bucket_cap_mb": bucket_mb}, (None, _trivial, None)
    else:
        options, (hook_state, inner, state) = modes.get(mode).ddp_options(bucket_mb), modes.get(mode).comm_hook()
    ddp = nn.parallel.DistributedDataParallel(task.model(), **options)  # PowerSGD: one bucket, as bench train runs it
    opt = train.make_optimizer("sgd", ddp.parameters(), train.task_lr(task, "sgd"))
    spent = [0.0, 0]

    def timed(hook_state, bucket):  # DDP checks the hook's parameter names
        t0 = time.thread_time()
        fut = inner(hook_state, bucket)
        spent[0] += time.thread_time() - t0
        spent[1] += 1
        return fut

    ddp.register_comm_hook(hook_state, timed)
    for step in range(steps):
        if step == 40:
            spent[:] = [0.0, 0]
        x, y = task.batch_for(step, rank)
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        opt.step()
    if state is not None:
        state.close()
    return spent[0] / max(spent[1], 1), spent[1] / max(steps - 40, 1)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task_name, bucket_mb, steps, reps, names = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4]), sys.argv[5].split(",")
    per_bucket = {m: [] for m in names}
    buckets = {}
    for _ in range(reps):
        for mode in names:
            cost, buckets[mode] = one_run(task_name, bucket_mb, steps, mode, rank)
            per_bucket[mode].append(cost)
    if rank == 0:
        print(f"{task_name}, buckets of {bucket_mb} MB, {steps} steps, {reps} runs a mode: the hook's CPU a bucket "
              "(us; median of the runs' means, then each run's)")
        for mode in names:
            runs = " ".join(f"{1e6 * c:.0f}" for c in per_bucket[mode])
            print(f"  {mode:16s} {1e6 * statistics.median(per_bucket[mode]):7.0f}   ({runs}; {buckets[mode]:.0f} "
                  "buckets a step)")
    dist.destroy_process_group()

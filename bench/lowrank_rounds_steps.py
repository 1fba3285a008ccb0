"""The wide model's step under one mode (median ms of steps 35-79), run once
per rank under torch.distributed's env:// variables (bench/README
"lowrank's rounds together"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit -- python bench/lowrank_rounds_steps.py MODE

MODE: local (a hook that communicates nothing: the compute alone), lowrank4 /
lowrank16 (a fixed rank, across nodes), lowrank4n (rank 4, flat); a suffix
1b puts the model in one DDP bucket (else DDP's default buckets: two). For
lowrank, rank 0 prints the last step's transport calls and
``stats()["lowrank_rounds"]``.
"""
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

import hetcomm
from hetcomm.benchmarks import common, tasks, train

LOWRANK = {"lowrank4": {"matrix_approximation_rank": 4}, "lowrank16": {"matrix_approximation_rank": 16},
           "lowrank4n": {"matrix_approximation_rank": 4, "algorithm": "native"}}


def local_hook(_, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mode = sys.argv[1]
    one = mode.endswith("1b")
    mode = mode[:-2] if one else mode
    if one:
        dist._DEFAULT_FIRST_BUCKET_BYTES = 100 << 20  # DDP's first bucket is 1 MB otherwise
    task = tasks.TASKS["wide"]()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(task.model(), bucket_cap_mb=100 if one else None)
    opt = train.make_optimizer("sgd", ddp.parameters(), train.task_lr(task, "sgd"))
    state = None
    if mode == "local":
        ddp.register_comm_hook(None, local_hook)
    else:
        state = hetcomm.HookState("lowrank", **LOWRANK[mode])
        ddp.register_comm_hook(state, hetcomm.hook)
    times = common.timed_steps(ddp, opt, task, rank, 80)
    if rank == 0:
        print(f"{sys.argv[1]}: {1000 * statistics.median(times[35:]):.1f} ms a step")
        if state is not None:
            stats = state.stats()
            print("transport calls a step:", stats["last_step"]["collectives"], "rounds:", stats["lowrank_rounds"])
    if state is not None:
        state.close()
    dist.destroy_process_group()

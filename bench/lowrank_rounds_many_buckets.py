"""A deep MLP in many DDP buckets under lowrank at rank 4, its rounds measured
(trial) or fixed (pipelined, together): median ms of steps 35-69, run once
per rank under torch.distributed's env:// variables (bench/README "lowrank's
rounds together"):

    hetcomm testbed --nodes 2 --ranks-per-node 2 --inter-node-rate 100mbit -- \
        python bench/lowrank_rounds_many_buckets.py trial|pipelined|together WIDTH DEPTH BUCKET_MB BATCH
"""
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import hetcomm

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rounds, width, depth, cap, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(width, 10)), bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    state = hetcomm.HookState("lowrank", matrix_approximation_rank=4)
    if rounds != "trial":
        state.load_state_dict({**state.state_dict(), "lowrank_rounds": {"choice": rounds, "times": {}}})
    ddp.register_comm_hook(state, hetcomm.hook)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(70):
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    if rank == 0:
        stats = state.stats()
        print(f"{rounds}: {1000 * statistics.median(times[35:]):.1f} ms a step, {stats['last_step']['buckets']} buckets, "
              f"{stats['last_step']['collectives']} transport calls a step, {stats['lowrank_rounds']}")
    state.close()
    dist.destroy_process_group()

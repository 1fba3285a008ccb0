"""Peak memory of a lowrank run (bench/README "lowrank without its M
buffer"): DDP on loopback ranks, 8 x Linear(2048, 2048) (33.6M parameters, a
134 MB float32 gradient), lowrank at rank 4, 40 steps; rank 0 prints the
rounds lowrank chose and the process's peak resident memory (VmHWM) after
step 5 and after step 40.

    torchrun --nproc-per-node 2 bench/lowrank_memory.py
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm


def peak_mb() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 1024


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]))
    state = hetcomm.HookState("lowrank", matrix_approximation_rank=4)
    model.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    early = 0.0
    for step in range(40):
        opt.zero_grad()
        model(torch.randn(8, 2048)).pow(2).mean().backward()
        opt.step()
        if step == 5:
            early = peak_mb()
    if dist.get_rank() == 0:
        rounds = state.stats().get("lowrank_rounds", {}).get("rounds")
        print(f"rounds {rounds}: peak resident memory {early:.0f} MB after step 5, {peak_mb():.0f} MB after 40")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

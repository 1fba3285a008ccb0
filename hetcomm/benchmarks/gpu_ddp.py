"""DDP step time on GPUs (NCCL), hetcomm's modes next to PyTorch's hooks.
Run with torchrun on a machine with 2+ GPUs (bench/gpu/run.sh does)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import hetcomm

from .ddp import IN, OUT, model_for

MODES = ["torch-allreduce", "torch-fp16", "none", "fp16", "bf16", "onebit", "topk", "lowrank"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=int, default=25_000_000)
    p.add_argument("--batch", type=int, default=64, help="per GPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local)
    rows = []
    for mode in MODES:
        model = model_for(args.params).to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local])
        state = None
        if mode.startswith("torch-"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.allreduce_hook if mode == "torch-allreduce"
                                   else default_hooks.fp16_compress_hook)
        else:
            state = hetcomm.HookState(mode)
            ddp.register_comm_hook(state, hetcomm.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x = torch.randn(args.batch, IN, device=device)
        y = torch.randint(0, OUT, (args.batch,), device=device)
        times = []
        for step in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        times.sort()
        row = {"mode": mode, "step_ms": 1000 * times[len(times) // 2]}
        if state is not None:
            row["bytes_per_step"] = state.stats()["last_step"]["bytes_sent"]
            state.close()
        rows.append(row)
        if dist.get_rank() == 0:
            print(row, flush=True)
    if dist.get_rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A mixed cluster in one DDP job: each rank in its own compute precision.

    torchrun --nproc_per_node 2 examples/mixed_precision.py
    torchrun --nproc_per_node 2 examples/mixed_precision.py --precisions bf16,fp16 --overflow-at 50

By default each rank takes the precision of its device (hetcomm.amp.precision_for:
bf16 on an A100/H100, fp16 with loss scaling on a V100, fp32 on a CPU without
native bf16); --precisions sets rank r's to the r-th entry (cycled), as if the
ranks were different GPUs. Trains an MLP on scikit-learn's digits with AdamW
and onebit compression; --overflow-at makes the first fp16 rank's loss overflow
at that step (every rank must skip it). Rank 0 prints a JSON line at the end.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm.demo import load_digits, make_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compression", default="onebit")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--precisions", default=None, help="comma-separated, rank r takes entry r (cycled)")
    p.add_argument("--overflow-at", type=int, default=-1)
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun's env:// variables
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, x_test, y_test = load_digits()
    model = make_model(seed=0)
    ddp = DDP(model)
    opt = hetcomm.optim.AdamW(ddp.parameters(), lr=args.lr)
    state = hetcomm.HookState(args.compression).attach_optimizer(opt)
    ddp.register_comm_hook(state, hetcomm.hook)
    precision = args.precisions.split(",")[rank % len(args.precisions.split(","))] if args.precisions else None
    scaler = hetcomm.amp.GradScaler(state, "cpu", precision=precision)  # None: this rank's device decides

    taken = []  # the optimizer steps this rank took (an overflow anywhere skips the step on every rank)
    opt.register_step_post_hook(lambda *_: taken.append(1))
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * world + rank)  # this rank's batch of this step
        idx = torch.randint(0, len(y), (args.batch,), generator=g)
        opt.zero_grad()
        with scaler.autocast():  # bf16, fp16 or nothing, as this rank's precision says
            loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        if step == args.overflow_at and scaler.precision == "fp16":
            loss = loss * 1e9  # an fp16 overflow on this rank
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    every, steps_taken = [None] * world, [None] * world
    dist.all_gather_object(every, flat)
    dist.all_gather_object(steps_taken, len(taken))
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:
        print(json.dumps({"precisions": state.stats()["precisions"], "accuracy": acc,
                          "replicas_identical": all(torch.equal(flat, f) for f in every),
                          "optimizer_steps": steps_taken, "hook_steps": state.iter}))
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

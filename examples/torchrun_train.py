"""DDP + hetcomm under torchrun, with checkpoint and resume.

    torchrun --nproc_per_node 2 examples/torchrun_train.py --steps 200 --ckpt /tmp/ckpt
    torchrun --nproc_per_node 2 examples/torchrun_train.py --steps 300 --ckpt /tmp/ckpt --resume
    torchrun --nproc_per_node 2 examples/torchrun_train.py --compression onebit --attach --ckpt /tmp/ckpt1
    torchrun --nproc_per_node 2 examples/torchrun_train.py --optim adamw --precisions bf16,fp16 --ckpt /tmp/ckpt2
    torchrun --nproc_per_node 2 examples/torchrun_train.py --optim adamw --schedule linear --clip 1 --ckpt /tmp/ckpt3

Trains an MLP on scikit-learn's digits with SGD (momentum 0.9; --optim adamw:
hetcomm.optim.AdamW) and hetcomm's default, compression="auto" (or
--compression MODE; --attach: the momentum compressed, attach_optimizer with
the run's length, as onebit and topk want under a momentum); --precisions: rank
r computes in the r-th entry (cycled) under hetcomm.amp.GradScaler, as if the
ranks were different GPUs, and --overflow-at makes the fp16 ranks' loss overflow
at that step (every rank skips it); --schedule linear: a warm-up and a linear
decay of the rate. Saves model, optimizer, the scaler, the schedule and each
rank's hetcomm state every --save-every steps and after each --save-at step;
--resume continues from the last checkpoint as if the run had never stopped
(bit for bit with a fixed mode; with auto, whose choices follow measured step
times, wherever the resumed run measures the same choices; on another number
of ranks: from the saved step, error feedback afresh). Rank 0 prints a JSON
line at the end.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm.demo import load_digits, make_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compression", default="auto")
    p.add_argument("--total-steps", type=int, default=None,
                   help="the run's planned length, if --steps stops it sooner (--attach's warm-up is its first fifth)")
    p.add_argument("--attach", action="store_true",
                   help="compress the momentum (attach_optimizer, its warm-up the run's first fifth)")
    p.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=None, help="default 0.05 (sgd), 3e-3 (adamw)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ckpt", required=True, help="checkpoint folder")
    p.add_argument("--save-every", type=int, default=50, help="save after every this many steps; 0: only at --save-at")
    p.add_argument("--save-at", default="", help="comma-separated steps to save after as well (e.g. 30: after step 30)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--clip", type=float, default=None,
                   help="clip the gradient at this norm (by the reduced gradient's: state.clip_grad_norm_)")
    p.add_argument("--precisions", default=None,
                   help="comma-separated fp32 / bf16 / fp16, rank r takes entry r (cycled); default: no autocast")
    p.add_argument("--overflow-at", type=int, default=-1, help="the fp16 ranks' loss overflows at this step")
    p.add_argument("--schedule", choices=("constant", "linear"), default="constant",
                   help="linear: a warm-up over the run's first tenth, then a linear decay to 0 (as transformers' "
                        "get_linear_schedule_with_warmup), over --total-steps or --steps; saved with the checkpoint")
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun's env:// variables
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y, x_test, y_test = load_digits()
    model = make_model(seed=0)
    ddp = DDP(model)
    if args.optim == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr or 0.05, momentum=0.9)
    else:
        opt = hetcomm.optim.AdamW(ddp.parameters(), lr=args.lr or 3e-3)
    state = hetcomm.HookState(args.compression)
    if args.attach:
        state.attach_optimizer(opt, total_steps=args.total_steps or args.steps)
    ddp.register_comm_hook(state, hetcomm.hook)
    scaler = None  # without --precisions: fp32, no scaler, as most users start
    if args.precisions:
        names = args.precisions.split(",")
        scaler = hetcomm.amp.GradScaler(state, "cpu", precision=names[rank % len(names)])
    planned = args.total_steps or args.steps
    warm = max(1, planned // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, (lambda s: min((s + 1) / warm, max(0.0, (planned - s) / (planned - warm)))) if args.schedule == "linear"
        else (lambda s: 1.0))
    taken = [0]  # the optimizer steps taken (a non-finite gradient on any rank skips the step on every rank)
    opt.register_step_post_hook(lambda *_: taken.__setitem__(0, taken[0] + 1))

    save_at = {int(v) for v in args.save_at.split(",") if v}
    os.makedirs(args.ckpt, exist_ok=True)
    path = os.path.join(args.ckpt, f"rank{rank}.pt")  # every rank its own file: residuals are per rank
    start = 0
    if args.resume:
        # resumed on more ranks (torchrun --nnodes MIN:MAX), a rank the saving run lacked takes rank 0's file;
        # strict=False: on another world size the step count goes on and each rank's error feedback starts afresh
        # weights_only: the model's, the optimizer's and hetcomm's states are tensors and containers (torch's safe loader)
        ck = torch.load(path if os.path.exists(path) else os.path.join(args.ckpt, "rank0.pt"), weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        state.load_state_dict(ck["hetcomm"], strict=False)
        if scaler is not None:
            scaler.load_state_dict(ck["scaler"])  # the loss scale as the saving run left it (an fp16 backoff)
        start, taken[0] = ck["step"], ck["optimizer_steps"]
        if start >= args.steps and rank == 0:  # (the last save of a finished run: --save-every's)
            print(f"the checkpoint is of step {start}, at or past --steps {args.steps}: no step left to run "
                  "(--save-every 0 saves only at --save-at)", file=sys.stderr)
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(step * world + rank)  # this rank's batch of this step
        idx = torch.randint(0, len(y), (args.batch,), generator=g)
        opt.zero_grad()
        if scaler is None:
            torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
        else:
            with scaler.autocast():  # bf16, fp16 or nothing, as this rank's precision says
                loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
            if step == args.overflow_at and scaler.precision == "fp16":
                loss = loss * 1e9  # an fp16 overflow on this rank
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # checks (the hook reduced the gradients unscaled); clip_grad_norm_ after it
        if args.clip is not None:
            state.clip_grad_norm_(model.parameters(), args.clip)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        sched.step()
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 in save_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hetcomm": state.state_dict(),
                        "scaler": scaler.state_dict() if scaler is not None else None, "sched": sched.state_dict(),
                        "step": step + 1,
                        "optimizer_steps": taken[0]}, path)
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    every, mine = [None] * world, [None] * world
    dist.all_gather_object(every, flat)
    stats = state.stats()
    share = stats.get("lowrank_share")
    dist.all_gather_object(mine, {"optimizer_steps": taken[0], "loss_scale": scaler.loss_scale() if scaler else None,
                                  "share_readings": share and share.get("readings")})
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    if rank == 0:  # plans: what the last step sent per bucket; lowrank_guard: auto's reading of lowrank's rank
        print(json.dumps({"steps": args.steps, "hook_steps": state.iter, "accuracy": acc,
                          "replicas_identical": all(torch.equal(flat, f) for f in every),
                          "compression_ratio": stats["last_step"]["compression_ratio"],
                          "plans": sorted(f"{p['mode']}/{p['algorithm']}" for p in stats["plans"].values()),
                          "lowrank_guard": stats.get("auto", {}).get("lowrank_guard"),
                          "lowrank_share": stats.get("lowrank_share"), "precisions": stats.get("precisions"),
                          "clip": stats.get("clip"), "lr": opt.param_groups[0]["lr"],
                          "ranks": mine,
                          "checksum": float(flat.double().sum())}))
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

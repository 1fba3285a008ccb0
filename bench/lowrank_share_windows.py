"""The windows of lowrank's share reading along auto's path: fp8 of the
gradient, 2 loopback ranks, fp32's learning rate, DDP's default buckets. At
every step of the windows 20-40, 100-120 and 200-220 (every 5th) each rank
reads the share of its local gradient's energy in the top r singular values
(r = 4, 8, 16) of every weight matrix (a parameter of 2 or more dimensions,
as (rows, rest); skipped where a side is at most r), summed over the
matrices; printed: each rank's mean per window. Where `lowrank_guard.ADMIT`
and `DROP` come from (bench/README "lowrank in auto, under a guard").

    python bench/lowrank_share_windows.py sgd lm:0 lm:1 wide:0 classify:0 regress:0

``--early`` (first): the windows a first reading could take instead, every
5th step of 5-15, 10-20, 15-25, 20-30 and 20-40 (bench/README "Could the
first reading come earlier?"). ``--first``: the first window of 20-30
read every 5th, every 2nd and every step, against 20-40 every 5th (bench/README
"The first reading at step 30"). ``--late``: auto's windows up to step 820
(20-30, 50-60, 80-90, 100-120, 200-220, 400-420, 800-820, every 5th);
with ``--warmup=N`` the learning rate's linear warm-up over N steps
(``--schedule warmup`` of a run of 20 N steps), ``--world=W`` W ranks
(bench/README "A refused lowrank reads again").
"""
import sys

import torch
from torch import nn

import hetcomm
from hetcomm.benchmarks import tasks, train
from hetcomm.launch import spawn_ranks
from hetcomm.lowrank_share import top_share

WINDOWS = [list(range(20, 41, 5)), list(range(100, 121, 5)), list(range(200, 221, 5))]
EARLY = [list(range(a, b + 1, 5)) for a, b in ((5, 15), (10, 20), (15, 25), (20, 30), (20, 40))]
FIRST = [list(range(20, 31, 5)), list(range(20, 31, 2)), list(range(20, 31)), list(range(20, 41, 5))]
LATE = [list(range(a, a + span + 1, 5)) for a, span in ((20, 10), (50, 10), (80, 10), (100, 20), (200, 20),
                                                         (400, 20), (800, 20))]
RANKS = (4, 8, 16)


def body(rank, world, name, seed, optim, windows=WINDOWS, warmup=0):
    steps = sorted({s for w in windows for s in w})
    task = tasks.TASKS[name]()
    task.seed = seed
    model = task.model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = train.make_optimizer(optim, ddp.parameters(), train.task_lr(task, optim))
    sched = train.make_schedule(opt, "warmup", round(warmup / train.LR_WARMUP_FRACTION)) if warmup else None
    state = hetcomm.HookState("fp8")
    gen = torch.Generator().manual_seed(0)
    now = {"step": 0}
    energy = {}  # (step, r) -> [top, total]

    def hook(st, bucket):  # this rank's gradient, before it is reduced
        if now["step"] in steps:
            for g in bucket.gradients():
                if g.dim() >= 2:
                    m = g.reshape(g.shape[0], -1)
                    for r in RANKS:
                        if min(m.shape) > r:
                            top, total = top_share(m, r, gen)
                            e = energy.setdefault((now["step"], r), [0.0, 0.0])
                            e[0] += top
                            e[1] += total
        return hetcomm.hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    for step in range(max(steps) + 1):
        now["step"] = step
        x, y = task.batch_for(step, rank)
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
    state.close()
    return {r: [sum(energy[s, r][0] / energy[s, r][1] for s in w) / len(w) for w in windows] for r in RANKS}


if __name__ == "__main__":
    args = sys.argv[1:]
    windows = {"--early": EARLY, "--first": FIRST, "--late": LATE}.get(args[0], WINDOWS)
    args = args[1:] if args[0] in ("--early", "--first", "--late") else args
    opts = {a.split("=")[0]: int(a.split("=")[1]) for a in args if a.startswith("--")}
    args = [a for a in args if not a.startswith("--")]
    optim, world, warmup = args[0], opts.get("--world", 2), opts.get("--warmup", 0)
    for case in args[1:]:
        name, seed = case.split(":")
        res = spawn_ranks(body, world, name, int(seed), optim, windows, warmup, timeout=3000)
        if warmup:
            print(f"(a {warmup}-step lr warm-up, {world} ranks)")
        for r in RANKS:
            print(name, "seed", seed, optim, "rank", r, "windows", " / ".join(f"{w[0]}-{w[-1]}/{w[1] - w[0]}" for w in windows) + ":",
                  " ".join(f"rank{k} " + "/".join(f"{v:.3f}" for v in res[k][r]) for k in range(world)), flush=True)

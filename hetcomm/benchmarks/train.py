"""`hetcomm bench train`: time to accuracy. Each task trains once per
optimizer and mode, every mode at fp32's best learning rate, side by side in
one run; the reference is PyTorch's own fp32 all-reduce (``allreduce_hook``).

Per run: the quality curve against training wall time (evaluation paused
out of the clock), the final quality, whether and when (steps, seconds) it
came within the task's tolerance of fp32's final quality, seconds per step,
bytes sent per step (ring-equivalent, per rank) and rank 0's minor page
faults per step (inside the clock; thousands a step on a CPU: the allocator
hands memory back and faults it in again, README "Limits"). Under ``hetcomm testbed``
the same command measures a simulated cluster (e.g. 2 nodes x 2 ranks at
100 Mbit between nodes)."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Dict, List, Optional

try:
    import resource
except ImportError:  # not on Windows: no fault counts there
    resource = None

import torch
import torch.distributed as dist
from torch import nn

import hetcomm

from .. import modes as mode_table
from ..launch import joined, run_distributed
from . import common
from .tasks import TASKS, Task
from .train_results import REFERENCE, aggregate, load_reference, summarise

DEFAULT_MODES = ["fp32", "torch-powersgd", "onebit", "onebit+m", "topk+m", "lowrank", "lowrank+m"]
OPTIMIZERS = ("sgd", "adamw", "nesterov", "plain", "sgd-fused", "adamw-fused")
#: torch's fused kernels (``fused=True``), not hetcomm's: on CPU ranks AdamW's step in 0.3x-0.1x the time of the loop
#: torch runs there unless asked (bench/README "torch's fused AdamW"); no +m modes, which step hetcomm's own
FUSED = "-fused"
OPTIMIZERS_HELP = ("comma-separated optimizers: sgd (momentum 0.9), adamw (default both), nesterov (SGD, Nesterov "
                   "momentum 0.9, at sgd's lr), plain (SGD without momentum, at its own lr; no +m modes), "
                   "sgd-fused / adamw-fused (torch's with fused=True, at sgd's / adamw's lr; no +m modes)")
DEFAULT_OPTIMIZERS = ["sgd", "adamw"]
SCHEDULES = ("constant", "warmup", "cosine", "onecycle")
#: the warmup and cosine schedules' linear warm-up, as a fraction of the run's steps (``warmup:N``: N steps)
LR_WARMUP_FRACTION = 0.05


def check_schedule(name: str) -> str:
    """``name`` if it names a schedule: one of SCHEDULES, or ``warmup:N`` /
    ``cosine:N`` (a linear warm-up of N steps, N >= 1, instead of the run's
    first LR_WARMUP_FRACTION); else ValueError naming the rule."""
    kind, sep, warm = name.partition(":")
    if kind not in SCHEDULES or (sep and (kind not in ("warmup", "cosine") or not warm.isdigit() or int(warm) < 1)):
        raise ValueError(f"schedule must be one of {SCHEDULES}, or warmup:N / cosine:N with N >= 1 warm-up steps, "
                         f"got {name!r}")
    return name


def make_optimizer(name: str, params, lr: float, attach: bool = False) -> torch.optim.Optimizer:
    """SGD momentum 0.9 (``nesterov``: Nesterov's; ``plain``: no momentum), or
    AdamW (hetcomm's where its momentum is compressed: the recommended pairing);
    ``sgd-fused`` / ``adamw-fused``: torch's with ``fused=True``."""
    base, fused = name.removesuffix(FUSED), name.endswith(FUSED)
    if fused and attach:
        raise ValueError(f"optimizer {name!r} is torch's fused kernel: a mode that compresses the momentum (+m) "
                         f"steps hetcomm's own optimizer; run it with {base!r}")
    kernel = {"fused": True} if fused else {}  # (left out: torch decides, on the CPU its loop)
    if name == "plain":
        return torch.optim.SGD(params, lr=lr)
    if base in ("sgd", "nesterov"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=base == "nesterov", **kernel)
    return hetcomm.optim.AdamW(params, lr=lr) if attach else torch.optim.AdamW(params, lr=lr, **kernel)


def make_schedule(optimizer: torch.optim.Optimizer, name: str, steps: int):
    """The learning-rate schedule ``name`` over a run of ``steps`` optimizer
    steps, stepped once after each: None for ``constant``; ``warmup``, a
    linear warm-up over the first ``LR_WARMUP_FRACTION`` of the steps (step s
    at (s + 1) / w of the lr; ``warmup:N``: over N steps), then the lr held (transformers'
    ``get_constant_schedule_with_warmup``); ``cosine``, what transformer
    recipes use, the same warm-up and then a cosine decay towards 0 at the
    end; ``onecycle``, torch's
    ``OneCycleLR`` with its defaults and the optimizer's lr as ``max_lr``
    (the lr up from max_lr / 25 over 30 % of the steps, then down to max_lr /
    25e4, and the momentum, SGD's or Adam's beta1, cycled from 0.95 to 0.85
    and back)."""
    name, _, given = check_schedule(name).partition(":")
    if name == "constant":
        return None
    if name == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=optimizer.param_groups[0]["lr"],
                                                   total_steps=steps)
    warm = int(given) if given else max(1, int(LR_WARMUP_FRACTION * steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if name == "warmup":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def task_lr(task: Task, optim: str) -> float:
    """fp32's learning rate of ``task`` for ``optim`` (Nesterov runs at SGD-momentum's, a fused kernel at its
    optimizer's)."""
    base = optim.removesuffix(FUSED)
    return task.lr["sgd" if base == "nesterov" else base]


def _register(ddp, mode: str, opt: torch.optim.Optimizer, steps: int):
    """Registers the mode's hook (an attached optimizer warms up for a fifth
    of the ``steps``); returns (hetcomm state or None, bytes per step function)."""
    m = mode_table.get(mode)
    state = m.register(ddp, opt, total_steps=steps)
    if state is not None:
        return state, lambda done: state.stats()["total"]["bytes_sent"] / max(done, 1)
    return None, lambda done: m.torch_bytes(ddp.module, dist.get_world_size(), done)


def setup(task: Task, mode: str, optim: str, steps: int, rank: int, device: str = "cpu",
          bucket_mb: Optional[float] = None, lr: Optional[float] = None):
    """A run of ``task``'s model as ``hetcomm bench train`` makes it, on
    ``rank``'s device: DDP in the mode's layout (PyTorch's PowerSGD: one
    bucket; the others ``bucket_mb`` or DDP's default), the optimizer at
    ``lr`` (default fp32's), the mode's hook registered. Returns (model, ddp,
    optimizer, hetcomm state or None, bytes per step function); the bench/
    scripts that time modes against each other start their runs here too."""
    dev = common.rank_device(rank, device)
    m = mode_table.get(mode)
    model = task.model().to(dev)  # initialised on the CPU: the same start on either device
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                              **m.ddp_options(bucket_mb))
    opt = make_optimizer(optim, ddp.parameters(), task_lr(task, optim) if lr is None else lr, m.attach)
    state, bytes_per_step = _register(ddp, mode, opt, steps)
    return model, ddp, opt, state, bytes_per_step


def _clip(state, model: nn.Module, clip: Optional[float], handed: bool) -> bool:
    """Clips the step's gradients at norm ``clip`` (None: not at all): by the
    reduced gradient's norm (hetcomm's HookState.clip_grad_norm_), or with
    ``handed`` / a PyTorch hook by torch's, of the handed gradient. Whether it clipped."""
    if clip is None:
        return False
    if state is not None and not handed:
        norm = state.clip_grad_norm_(model.parameters(), clip)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return bool(norm > clip)


def _minor_faults() -> int:
    """This process's minor page faults so far, every thread's (0 where the
    platform does not count them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _run(rank: int, task: Task, optim: str, mode: str, steps: int, eval_every: int, lr: float,
         clip: Optional[float] = None, clip_handed: bool = False, schedule: str = "constant",
         device: str = "cpu", bucket_mb: Optional[float] = None) -> Optional[Dict]:
    dev = common.rank_device(rank, device)
    model, ddp, opt, state, bytes_per_step = setup(task, mode, optim, steps, rank, device, bucket_mb, lr)
    sched = make_schedule(opt, schedule, steps)
    curve, train_s, clipped, faults = [], 0.0, 0, 0
    for step in range(steps):
        x, y = (t.to(dev) for t in task.batch_for(step, rank))
        f0 = _minor_faults()
        t0 = time.perf_counter()
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        clipped += _clip(state, model, clip, clip_handed)
        opt.step()
        if sched is not None:
            sched.step()
        common.sync(dev)  # a GPU's step counts when it is done, not when it is queued
        train_s += time.perf_counter() - t0
        faults += _minor_faults() - f0
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            if rank == 0:
                point = {"step": step + 1, "time_s": train_s, **task.evaluate(model)}
                if state is not None:
                    point["plans"] = common.plan_summary(state)
                curve.append(point)
            dist.barrier()  # every rank resumes the clock together
    sent = bytes_per_step(steps)
    auto = common.auto_record(state)
    stats = state.stats() if state is not None else {}
    ladder = stats.get("lowrank_rank")  # lowrank's rank, as it chose
    rounds = stats.get("lowrank_rounds")  # and its rounds a step
    # bytes to ranks on other nodes (PyTorch's hooks on the backend's all-reduce: its share of peers off the
    # node, stats()' convention for a backend's collective)
    across = stats["total"]["bytes_sent_across_nodes"] / steps if stats else sent * common.off_node_share()
    if state is not None:
        state.close()
    if rank != 0:
        return None
    final = curve[-1]
    extra = {**({"auto": auto} if auto else {}), **({"lowrank_rank": ladder} if ladder else {}),
             **({"lowrank_rounds": rounds} if rounds else {})}
    return {**extra, "task": task.name, "optimizer": optim, "mode": mode, "seed": task.seed, "lr": lr,
            "schedule": schedule, "steps": steps, "device": device,
            "world_size": dist.get_world_size(),
            "curve": curve, "final": final[task.metric], "final_loss": final["loss"],
            "s_per_step": train_s / steps, "bytes_per_step": sent, "bytes_across_nodes_per_step": across,
            "minor_faults_per_step": faults / steps,
            "clip": None if clip is None else {"max_norm": clip, "by": "handed" if clip_handed or state is None
                                               else "reduced", "clipped_steps": clipped},
            "finite": math.isfinite(final["loss"])}


def _worker(rank: int, world: int, tasks: List[str], optims: List[str], modes: List[str], scale: float,
            eval_every: int, lr_scale: float, partial_path: Optional[str] = None, seeds: int = 1,
            clip: Optional[float] = None, clip_handed: bool = False, schedule: str = "constant",
            device: str = "cpu", bucket_mb: Optional[float] = None, first_seed: int = 0) -> List[Dict]:
    with common.denormals_flushed(device) as flushed:  # every mode's runs alike
        out = []
        for name in tasks:
            task = TASKS[name]()
            steps = max(eval_every, int(task.steps * scale))
            for optim in optims:
                for seed in range(first_seed, first_seed + seeds):
                    task.seed = seed
                    for mode in modes:
                        r = _run(rank, task, optim, mode, steps, eval_every, task_lr(task, optim) * lr_scale, clip,
                                 clip_handed, schedule, device, bucket_mb)
                        if r is not None:
                            r["denormals_flushed"] = flushed
                            plans = r["curve"][-1].get("plans")
                            print(f"  {name:9s} {optim:6s} seed {seed} {mode:15s} {task.metric} {r['final']:.4g}  "
                                  f"{1000 * r['s_per_step']:.1f} ms/step  "
                                  f"{r['minor_faults_per_step']:.0f} faults/step" +
                                  (f"  last step: {plans}" if plans else ""),
                                  file=sys.stderr, flush=True)
                            out.append(r)
                            # kept if a later run fails
                            common.write_json(partial_path, {"partial": True, "runs": out})
        return out


def plot(runs: List[Dict], path: str) -> bool:
    """Quality against training time: a row per optimizer, a column per task
    (matplotlib); the y range follows fp32's curve so a diverged run does not
    flatten the others."""
    plt = common.pyplot("bench train")
    if plt is None:
        return False
    tasks = [t for t in TASKS if any(r["task"] == t for r in runs)]
    optims = [o for o in OPTIMIZERS if any(r["optimizer"] == o for r in runs)]
    fig, axes = plt.subplots(len(optims), len(tasks), figsize=(4.6 * len(tasks), 3.4 * len(optims)), squeeze=False)
    for i, optim in enumerate(optims):
        for j, task in enumerate(tasks):
            ax, metric = axes[i][j], TASKS[task].metric
            panel = [r for r in runs if (r["task"], r["optimizer"]) == (task, optim)]
            seeded = len({r["seed"] for r in panel}) > 1
            for r in panel:
                label = r["mode"] + (f" seed {r['seed']}" if seeded else "") + \
                    (" (its times: --reference's)" if r.get("reference_from") else "")
                ax.plot([p["time_s"] for p in r["curve"]], [p[metric] for p in r["curve"]], label=label,
                        lw=2.2 if r["mode"] == REFERENCE else 1.2, color="black" if r["mode"] == REFERENCE else None)
            ref = [p[metric] for r in panel if r["mode"] == REFERENCE for p in r["curve"]]
            if ref and metric == "accuracy":
                ax.set_ylim(max(0.0, min(ref) - 10), 100.5)
            elif ref:
                ax.set_yscale("log")
                ax.set_ylim(0.8 * min(ref), 1.5 * max(ref))
            sched = "" if panel[0].get("schedule", "constant") == "constant" else f", {panel[0]['schedule']}"
            common.finish_axis(ax, f"{task} / {optim} (lr {panel[0]['lr']:g}{sched})", "training time (s)", metric)
    return common.save_figure(plt, fig, path)


def reference_runs(reference: str, ranks: int, tasks: List[str], optims: List[str], modes: List[str],
                   scale: float = 1.0, eval_every: int = 20, lr_scale: float = 1.0, seeds: int = 1,
                   clip: Optional[float] = None, schedule: str = "constant", device: str = "cpu",
                   bucket_mb: Optional[float] = None, first_seed: int = 0) -> List[Dict]:
    """The fp32 runs that :func:`run` with these arguments takes from
    ``reference`` (:func:`load_reference`); ValueError where it cannot."""
    if REFERENCE in modes:
        raise ValueError(f"--reference replaces the {REFERENCE} runs: leave {REFERENCE} out of --modes")
    if not modes:
        raise ValueError("--reference needs --modes to compare with it")
    world = int(os.environ["WORLD_SIZE"]) if joined() else ranks
    wanted = []
    for name in tasks:
        steps = max(eval_every, int(TASKS[name]().steps * scale))
        evals = list(range(eval_every, steps + 1, eval_every)) + ([steps] if steps % eval_every else [])
        for optim in optims:
            for seed in range(first_seed, first_seed + seeds):
                wanted.append({"task": name, "optimizer": optim, "seed": seed, "steps": steps, "evals": evals,
                               "lr": task_lr(TASKS[name](), optim) * lr_scale, "schedule": schedule,
                               "device": device, "world_size": world, "clip": clip})
    return load_reference(reference, wanted, bucket_mb)


def run(ranks: int, tasks: List[str], optims: List[str], modes: List[str], scale: float = 1.0,
        eval_every: int = 20, lr_scale: float = 1.0, partial_path: Optional[str] = None,
        seeds: int = 1, clip: Optional[float] = None, clip_handed: bool = False,
        schedule: str = "constant", device: str = "cpu", bucket_mb: Optional[float] = None,
        reference: Optional[str] = None, first_seed: int = 0) -> List[Dict]:
    """``clip``: every run clips its gradients at that norm after backward
    (hetcomm's modes by the reduced gradient's norm, HookState.clip_grad_norm_;
    with ``clip_handed`` by the handed one's, torch's clip_grad_norm_, as a
    loop written for plain DDP does). ``schedule``: the learning rate's over
    each run (:func:`make_schedule`; the task's lr is its peak). ``device``:
    "cuda" puts each rank's model and buckets on a GPU (NCCL with a GPU per
    rank, else gloo ranks sharing the GPUs). ``bucket_mb``: DDP's
    ``bucket_cap_mb`` for every mode but PowerSGD, which takes one bucket
    (None: DDP's default, whose first bucket holds 1 MB). ``reference``: an
    earlier run's JSON whose fp32 runs set the targets instead of running
    fp32 again (:func:`load_reference`). ``first_seed``: the seeds run are
    ``first_seed`` .. ``first_seed + seeds - 1`` (to add seeds to an earlier
    run without repeating its own)."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if first_seed < 0:
        raise ValueError(f"first_seed must be >= 0, got {first_seed}")
    check_schedule(schedule)
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0 or None, got {clip!r}")
    for name in tasks:
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}: choose from {list(TASKS)}")
    for o in optims:
        if o not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {o!r}: choose from {OPTIMIZERS}")
    for m in modes:
        mode_table.get(m)
    attached = [m for m in modes if mode_table.get(m).attach]
    if "plain" in optims and attached:
        raise ValueError(f"optimizer 'plain' (SGD without momentum) has no momentum to compress: run "
                         f"{', '.join(attached)} without it")
    fused = [o for o in optims if o.endswith(FUSED)]
    if fused and attached:
        raise ValueError(f"optimizer(s) {', '.join(fused)} are torch's fused kernels, and {', '.join(attached)} "
                         "step hetcomm's own optimizer: run them apart")
    common.require_device(device, "hetcomm bench train")
    copied: List[Dict] = []
    if reference is not None:
        copied = reference_runs(reference, ranks, tasks, optims, modes, scale, eval_every, lr_scale, seeds, clip,
                                schedule, device, bucket_mb, first_seed)
    elif REFERENCE not in modes:
        modes = [REFERENCE] + list(modes)
    runs = run_distributed(_worker, ranks, tasks, optims, modes, scale, eval_every, lr_scale, partial_path, seeds,
                           clip, clip_handed, schedule, device, bucket_mb, first_seed,
                           backend=common.backend_for(device, ranks))
    return summarise(copied + runs) if runs is not None else []


def _fmt(v, f):
    return "-" if v is None else format(v, f)


def main(ranks: int, tasks: List[str], optims: List[str], modes: List[str], scale: float, eval_every: int,
         json_path: Optional[str], png_path: Optional[str], lr_scale: float = 1.0, seeds: int = 1,
         clip: Optional[float] = None, clip_handed: bool = False, schedule: str = "constant",
         device: str = "cpu", bucket_mb: Optional[float] = None, reference: Optional[str] = None,
         first_seed: int = 0) -> None:
    t0 = time.time()
    runs = run(ranks, tasks, optims, modes, scale, eval_every, lr_scale, json_path, seeds, clip, clip_handed,
               schedule, device, bucket_mb, reference, first_seed)
    if not runs:  # a rank other than 0 under torchrun / the testbed
        return
    world = runs[0]["world_size"]
    where = "" if device == "cpu" else f" on {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    print(f"# hetcomm bench train: {world} ranks{where}, each mode at fp32's learning rate; target = fp32's final "
          "quality within the task's tolerance (accuracy -0.5 pt, MSE +2 %, perplexity +3 %)")
    cols = [("task", "task", "s"), ("optimizer", "optim", "s"), ("mode", "mode", "s"), ("seed", "seed", "d"),
            ("final", "final", ".4g"),
            ("target", "fp32", ".4g"), ("steps_to_target", "steps", "d"), ("steps_to_stay", "stays from", "d"),
            ("spiked_at", "spiked at", "d"),
            ("time_to_target_s", "time(s)", ".2f"),
            ("vs_fp32", "vs fp32", ".2f"), ("vs_powersgd", "vs PowerSGD", ".2f"), ("s_per_step", "ms/step", ".1f"),
            ("bytes_per_step", "KB/step", ".1f"), ("across", "across KB", ".1f")]  # across: to other nodes
    print("  ".join(f"{h:>11}" for _, h, _ in cols))
    for r in runs:
        across = r.get("bytes_across_nodes_per_step")  # (not in a --reference run from before it was counted)
        row = dict(r, s_per_step=1000 * r["s_per_step"], bytes_per_step=r["bytes_per_step"] / 1000,
                   across=None if across is None else across / 1000)
        print("  ".join(f"{_fmt(row[k], f):>11}" for k, _, f in cols))
    meta = common.metadata(world, wall_s=time.time() - t0, scale=scale, eval_every=eval_every, lr_scale=lr_scale,
                           seeds=seeds, clip=clip, clip_handed=clip_handed, schedule=schedule, device=device,
                           bucket_mb=bucket_mb, reference=reference, first_seed=first_seed)
    if reference is not None:
        print(f"# fp32's runs (the targets, and the base of 'vs fp32') from {reference}, not run again: their "
              "times are that run's machine and network")
    for r in runs:
        if r["mode"] == REFERENCE and r["fp32_diverged"]:
            task = TASKS[r["task"]]
            best = (max if task.higher_is_better else min)(p[task.metric] for p in r["curve"])
            print(f"# fp32 diverged on {r['task']} {r['optimizer']} seed {r['seed']} (its {task.metric} ended "
                  f"{r['final']:.4g}, its own best {best:.4g}): that seed's target is no fp32 quality, and the means "
                  "over seeds leave it out")
    summary = aggregate(runs)
    if seeds > 1:
        print(f"# over {seeds} seeds: mean final quality; 'ok' = the mean is within tolerance of fp32's mean; "
              "time(s) = the mean over the seeds that reached; vs PowerSGD = the mean of the per-seed ratios, over "
              "the seeds where both reached ('of seeds'); stayed vs = the same ratio of the times from which each "
              "stayed within tolerance; summed vs = their summed times to target over PowerSGD's; spiked = the "
              "seeds whose quality at some evaluation was far off its best so far (perplexity or MSE over 1.5x its "
              "lowest, accuracy 10 points under its best), back or not")
        acols = [("task", "task", "s"), ("optimizer", "optim", "s"), ("mode", "mode", "s"),
                 ("final_mean", "mean", ".4g"), ("final_std", "std", ".3g"), ("fp32_mean", "fp32 mean", ".4g"),
                 ("reached_mean", "ok", ""), ("reached_seeds", "seeds ok", "d"), ("spiked_seeds", "spiked", "d"),
                 ("time_to_target_s", "time(s)", ".2f"),
                 ("vs_powersgd", "vs PowerSGD", ".2f"), ("vs_powersgd_seeds", "of seeds", "d"),
                 ("stay_vs_powersgd", "stayed vs", ".2f"), ("summed_vs_powersgd", "summed vs", ".2f")]
        print("  ".join(f"{h:>11}" for _, h, _ in acols))
        for a in summary:
            print("  ".join(f"{_fmt(a[k], f):>11}" for k, _, f in acols))
    common.write_json(json_path, {"runs": runs, "summary": summary}, meta)
    if png_path and plot(runs, png_path):
        print(f"# loss curves: {png_path}")

"""`hetcomm bench precision`: one DDP job, each rank in its own compute
precision (bf16 where the device has it, fp16 with loss scaling where not),
next to the all-fp32 and all-fp16 runs of the same task, side by side.

Per run: the training loss curve (evaluated in fp32 on the whole data set),
the final loss against all-fp32's, whether the replicas are bit-identical at
the end, and the steps each rank skipped (overflows). One rank's loss scale
can be forced to overflow (``--overflow-at``): every rank must skip that step.
``naive`` is what users try first: the same precisions with
``torch.amp.GradScaler`` on the fp16 ranks and PyTorch's ``allreduce_hook``.
"""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

import hetcomm

from .. import modes as mode_table
from ..amp import DTYPES, PRECISIONS
from ..launch import run_distributed
from . import common
from .tasks import TASKS
from .train import make_optimizer, task_lr

# config -> the precision of rank r (cycled over the ranks)
CONFIGS = {"fp32": ("fp32",), "fp16": ("fp16",), "mixed": ("bf16", "fp16"), "mixed3": ("bf16", "fp16", "fp32"),
           "naive": ("bf16", "fp16")}
REFERENCE = "fp32"


def precisions_of(config: str, world: int) -> List[str]:
    """Each rank's precision in ``config``: a name of CONFIGS, or precisions
    joined by "/" (e.g. "bf16/fp16/fp32"), cycled over the ranks."""
    cycle = CONFIGS[config] if config in CONFIGS else tuple(config.split("/"))
    for p in cycle:
        if p not in PRECISIONS:
            raise ValueError(f"config {config!r} is not one of {list(CONFIGS)} nor precisions of {PRECISIONS} "
                             "joined by '/'")
    return [cycle[r % len(cycle)] for r in range(world)]


def train(rank: int, world: int, config: str, mode: str = "none", *, task: str = "regress", optim: str = "sgd",
          steps: int = 200, overflow_at: Optional[int] = None, eval_every: int = 10,
          options: Optional[Dict] = None, batch: Optional[Sequence[int]] = None) -> Dict:
    """One run on this rank of a hetcomm mode of :mod:`hetcomm.modes` (with
    HookState ``options``; ``+m`` modes attach the optimizer with the run's
    ``total_steps``, as ``bench train``: its first fifth is the warm-up), or
    with ``config="naive"`` PyTorch's allreduce_hook and GradScaler.
    ``overflow_at``: the first fp16 rank's loss is multiplied by 1e9 at that
    step (an fp16 overflow). ``batch``: samples of each rank (batch-size
    weighting; default the task's on every rank).
    Returns the run's record (every rank: its own skipped steps and every
    rank's; the curve and the replica check are the same on every rank)."""
    t = TASKS[task]()
    precisions = precisions_of(config, world)
    prec = precisions[rank]
    model = t.model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    m = mode_table.get(mode if config != "naive" else "torch-allreduce")
    opt = make_optimizer(optim, ddp.parameters(), task_lr(t, optim), m.attach)
    options = {} if m.is_torch else {"min_compress_numel": 1024, **(options or {})}
    state = m.register(ddp, opt, total_steps=steps, **options)
    if config == "naive":
        scaler = torch.amp.GradScaler("cpu", enabled=prec == "fp16")
        autocast = torch.autocast("cpu", dtype=DTYPES[prec], enabled=prec != "fp32")
    else:
        scaler = hetcomm.amp.GradScaler(state, "cpu", precision=prec)
        autocast = scaler.autocast()
    taken = []
    opt.register_step_post_hook(lambda *_: taken.append(True))
    overflow_rank = precisions.index("fp16") if "fp16" in precisions else None
    curve, skipped, scales, train_s, overflow_wires = [], [], [], 0.0, None
    for step in range(steps):
        x, y = t.batch_for(step, rank)
        if batch is not None:
            x, y = x[:batch[rank]], y[:batch[rank]]
            state.set_local_batch_size(len(x))
        t0 = time.perf_counter()
        opt.zero_grad()
        with autocast:
            loss = t.loss(ddp(x), y)
        if step == overflow_at and rank == overflow_rank:
            loss = loss * 1e9
        before = len(taken)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        train_s += time.perf_counter() - t0
        if len(taken) == before:
            skipped.append(step)
        if step == overflow_at and state is not None:  # what the overflow's buckets were sent as
            overflow_wires = sorted({p.mode for p in state.last_plans.values()})
        scales.append(scaler.get_scale())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append({"step": step + 1, "loss": t.evaluate(model)["loss"]})  # evaluate: no_grad
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    skipped_per_rank = [None] * world
    dist.all_gather_object(skipped_per_rank, skipped)
    auto = common.auto_record(state)
    if state is not None:
        state.close()
    return {"config": config, "mode": mode if config != "naive" else "allreduce_hook", "task": task, "optimizer": optim,
            "precisions": precisions, "steps": steps, "world_size": world, "curve": curve,
            "final_loss": curve[-1]["loss"], "replicas_identical": all(torch.equal(every[0], e) for e in every),
            "replica_max_diff": max((every[0] - e).abs().max().item() for e in every),
            "skipped": skipped, "skipped_per_rank": skipped_per_rank,
            "skips_agree": all(k == skipped_per_rank[0] for k in skipped_per_rank), "scales": scales,
            "s_per_step": train_s / steps, "overflow_wires": overflow_wires,
            "last_plans": sorted(common.plan_summary(state)) if state is not None else None,
            "stats_precisions": state.stats()["precisions"] if state is not None else None,
            "auto": auto}


def _worker(rank: int, world: int, configs: List[str], modes: List[str], task: str, optims: List[str], steps: int,
            overflow_at: Optional[int], eval_every: int) -> List[Dict]:
    out = []
    for optim in optims:
        for config in configs:
            for mode in (modes if config != "naive" else ["-"]):
                r = train(rank, world, config, mode, task=task, optim=optim, steps=steps, overflow_at=overflow_at,
                          eval_every=eval_every)
                out.append(r)
                if rank == 0:
                    print(f"  {optim:6s} {config:7s} {r['mode']:15s} loss {r['final_loss']:.4g}  identical "
                          f"{r['replicas_identical']}  skipped {r['skipped_per_rank']}"
                          + (f"  lowrank guard {r['auto']['lowrank_guard']}" if (r["auto"] or {}).get("lowrank_guard")
                             else ""), file=sys.stderr, flush=True)
    return out


def summarise(runs: List[Dict]) -> List[Dict]:
    """Adds each run's final loss relative to all-fp32's with the same
    optimizer and mode (naive: fp32's none, i.e. a plain all-reduce)."""
    for r in runs:
        mode = "none" if r["config"] == "naive" else r["mode"]
        ref = next((x for x in runs if x["optimizer"] == r["optimizer"] and x["config"] == REFERENCE and
                    x["mode"] == mode), None)
        r["vs_fp32"] = r["final_loss"] / ref["final_loss"] if ref else None
    return runs


def plot(runs: List[Dict], path: str) -> bool:
    """Training loss against steps, a panel per optimizer."""
    plt = common.pyplot("bench precision")
    if plt is None:
        return False
    optims = list(dict.fromkeys(r["optimizer"] for r in runs))
    fig, axes = plt.subplots(1, len(optims), figsize=(5.5 * len(optims), 3.8), squeeze=False)
    for ax, optim in zip(axes[0], optims):
        for r in (x for x in runs if x["optimizer"] == optim):
            label = f"{r['config']} ({'/'.join(dict.fromkeys(r['precisions']))}) {r['mode']}"
            ax.plot([p["step"] for p in r["curve"]], [p["loss"] for p in r["curve"]], label=label,
                    lw=2.2 if r["config"] == REFERENCE else 1.2, color="black" if r["config"] == REFERENCE else None,
                    ls="--" if r["config"] == "naive" else "-")
        ref = [p["loss"] for r in runs if r["optimizer"] == optim and r["config"] == REFERENCE for p in r["curve"]]
        ax.set_yscale("log")
        if ref:
            ax.set_ylim(0.8 * min(ref), 1.5 * max(ref))
        common.finish_axis(ax, f"{runs[0]['task']} / {optim}, {runs[0]['world_size']} ranks", "step",
                           "training loss (fp32 eval)")
    return common.save_figure(plt, fig, path)


def main(ranks: int, configs: List[str], modes: List[str], task: str, optims: List[str], steps: int,
         overflow_at: Optional[int], eval_every: int, json_path: Optional[str], png_path: Optional[str]) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose from {list(TASKS)}")
    for c in configs:
        precisions_of(c, ranks)
    if REFERENCE not in configs:
        configs = [REFERENCE] + list(configs)
    t0 = time.time()
    runs = run_distributed(_worker, ranks, configs, modes, task, optims, steps, overflow_at, eval_every)
    if not runs:  # a rank other than 0 under torchrun / the testbed
        return
    runs = summarise(runs)
    world = runs[0]["world_size"]
    print(f"# hetcomm bench precision: {world} ranks, {task}, {steps} steps; forced overflow on the first fp16 rank "
          f"at step {overflow_at}; vs fp32 = final loss / the same mode's with every rank in fp32")
    print(f"{'optim':>6} {'config':>7} {'precisions':>22} {'mode':>15} {'loss':>9} {'vs fp32':>8} {'identical':>9} "
          f"{'skips agree':>11} {'skipped (rank 0)':>18}")
    for r in runs:
        print(f"{r['optimizer']:>6} {r['config']:>7} {','.join(r['precisions']):>22} {r['mode']:>15} "
              f"{r['final_loss']:9.4g} {r['vs_fp32']:8.3f} {str(r['replicas_identical']):>9} "
              f"{str(r['skips_agree']):>11} {str(r['skipped'][:6]):>18}")
    meta = common.metadata(world, wall_s=time.time() - t0, steps=steps, overflow_at=overflow_at, task=task)
    common.write_json(json_path, {"runs": [{k: v for k, v in r.items() if k != "scales"} for r in runs]}, meta)
    if png_path and plot(runs, png_path):
        print(f"# loss curves: {png_path}")

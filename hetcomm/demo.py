"""`hetcomm demo`: DDP on real data (scikit-learn's digits, 8x8 images, 10
classes) over N gloo ranks on this machine, once per communication mode, side
by side with PyTorch's own hooks."""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import modes as mode_table
from .benchmarks.common import plan_summary
from .launch import run_distributed

MODES = tuple(mode_table.MODES)  # every mode of hetcomm.modes
#: PyTorch's allreduce, fp16 and PowerSGD (rank 4) hooks next to hetcomm's modes (bf16, fp8 and int3 among them:
#: the wires auto chooses from), auto (the README's one line) last
DEFAULT_MODES = ["torch-allreduce", "torch-fp16", "torch-powersgd", "none", "fp16", "bf16", "fp8", "int3", "onebit",
                 "onebit+m", "topk", "topk+m", "lowrank", "auto"]


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """(x_train, y_train, x_test, y_test) as float32 / int64 tensors, pixels in [0, 1]."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError as e:  # pragma: no cover - the README's set-up installs it
        raise RuntimeError("hetcomm demo needs scikit-learn for its digits data: pip install scikit-learn") from e
    data = _load()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model(seed: int = 0, hidden: int = 256) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def train_digits(rank: int, world: int, names: List[str], steps: int = 600, batch: int = 32, lr: float = 0.02,
                 seed: int = 0, progress: bool = False) -> Dict[str, dict]:
    """Trains the digits MLP once per mode on an initialised process group.
    Every rank draws its own batches from its shard of the training set.
    Returns {mode: {accuracy, test_loss, step_ms, bytes_per_step, ...}}."""
    x_tr, y_tr, x_te, y_te = load_digits(seed=seed)
    shard = torch.arange(rank, len(y_tr), world)
    results = {}
    for mode in names:
        model = make_model(seed)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        state = mode_table.get(mode).register(ddp, opt, total_steps=steps)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        dist.barrier()
        times, losses = [], []
        for step in range(steps):
            idx = shard[torch.randint(0, len(shard), (batch,), generator=gen)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = nn.functional.cross_entropy(ddp(x_tr[idx]), y_tr[idx])
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            if progress and rank == 0 and (step + 1) % max(1, steps // 5) == 0:
                print(f"  {mode:<16} step {step + 1:>4}/{steps}", file=sys.stderr, flush=True)
        with torch.no_grad():
            logits = model(x_te)
            acc = (logits.argmax(1) == y_te).float().mean().item() * 100
            loss = nn.functional.cross_entropy(logits, y_te).item()
        numel = sum(p.numel() for p in model.parameters())
        window = max(1, steps // 50)
        plans: Dict[str, int] = {}
        if state is not None:
            st = state.stats()
            bytes_per_step = st["last_step"]["bytes_sent"]
            plans = plan_summary(state)
            state.close()
        else:
            bytes_per_step = mode_table.get(mode).torch_bytes(model, world)
        times.sort()
        results[mode] = {
            "accuracy": acc,
            "test_loss": loss,
            "step_ms": 1000 * times[len(times) // 2],
            "bytes_per_step": bytes_per_step,
            "plans": plans,  # the last step's buckets per wire/algorithm (what auto chose); {} for PyTorch's hooks
            "fp32_bytes_per_step": mode_table.ring_bytes(numel, world),
            "params": numel,
            # rank 0's training loss, averaged over windows of steps (for --plot)
            "loss_curve": [[i + len(w), sum(w) / len(w)] for i in range(0, steps, window)
                           for w in [losses[i:i + window]]],
        }
        dist.barrier()
    return results


def format_table(results: Dict[str, dict], world: int) -> str:
    lines = [f"{'mode':<16} {'accuracy %':>10} {'test loss':>10} {'bytes/step':>12} {'vs fp32':>8} {'step ms':>8}  "
             "last step's buckets"]
    for mode, r in results.items():
        ratio = r["fp32_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("nan")
        plans = ", ".join(f"{k} x{n}" for k, n in r.get("plans", {}).items()) or "-"
        lines.append(f"{mode:<16} {r['accuracy']:>10.2f} {r['test_loss']:>10.4f} {r['bytes_per_step']:>12,d} "
                     f"{ratio:>7.1f}x {r['step_ms']:>8.2f}  {plans}")
    return "\n".join(lines)


def plot(results: Dict[str, dict], path: str, world: int) -> bool:
    """Training loss against step per mode, and each mode's median step time."""
    from .benchmarks import common

    plt = common.pyplot("demo")
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for mode, r in results.items():
        left.plot([p[0] for p in r["loss_curve"]], [p[1] for p in r["loss_curve"]], label=mode)
    left.set_yscale("log")
    common.finish_axis(left, f"hetcomm demo: digits MLP, {world} gloo ranks", "step",
                       "training loss (rank 0, window mean)")
    names = list(results)
    right.barh(names, [results[m]["step_ms"] for m in names])
    right.set_xlabel("median step time (ms)")
    right.invert_yaxis()
    return common.save_figure(plt, fig, path, dpi=120)


def main(ranks: int = 2, modes: Optional[List[str]] = None, steps: int = 600, batch: int = 32,
         json_path: Optional[str] = None, lr: float = 0.02, png_path: Optional[str] = None) -> Dict[str, dict]:
    modes = modes or DEFAULT_MODES
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"hetcomm demo: unknown mode {m!r}; choose from {', '.join(MODES)}")
    if ranks < 1:
        raise SystemExit("hetcomm demo: --ranks must be >= 1")
    print(f"hetcomm demo: digits MLP, {ranks} gloo ranks on 127.0.0.1, {steps} steps x {batch} samples per rank, "
          f"SGD lr {lr} momentum 0.9",
          file=sys.stderr, flush=True)
    results = run_distributed(train_digits, ranks, modes, steps, batch, lr, 0, True)
    if results is None:  # a rank other than 0 of a torchrun / testbed job
        return {}
    ranks = int(os.environ.get("WORLD_SIZE", ranks)) if "RANK" in os.environ else ranks
    print(format_table(results, ranks))
    from .benchmarks import common

    common.write_json(json_path, {"ranks": ranks, "steps": steps, "batch": batch, "lr": lr, "results": results},
                      common.metadata(ranks, steps=steps, batch=batch, lr=lr))
    if png_path and plot(results, png_path, ranks):
        print(f"# loss curves and step times: {png_path}")
    return results

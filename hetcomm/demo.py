"""`hetcomm demo`: DDP on real data (scikit-learn's digits, 8x8 images, 10
classes) over N gloo ranks on this machine, once per communication mode, side
by side with PyTorch's own hooks."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

import hetcomm

# mode name -> (hook kind, HookState kwargs)
MODES = {
    "torch-allreduce": ("torch", "allreduce"),
    "torch-fp16": ("torch", "fp16"),
    "none": ("hetcomm", dict(compression="none")),
    "fp16": ("hetcomm", dict(compression="fp16")),
    "bf16": ("hetcomm", dict(compression="bf16")),
    "fp8": ("hetcomm", dict(compression="fp8")),
    "onebit": ("hetcomm", dict(compression="onebit")),
    "topk": ("hetcomm", dict(compression="topk", topk_ratio=0.01)),
    "lowrank": ("hetcomm", dict(compression="lowrank", matrix_approximation_rank=4)),
    # +m: the optimizer's momentum is compressed (HookState.attach_optimizer)
    "onebit+m": ("hetcomm", dict(compression="onebit", attach=True)),
    "topk+m": ("hetcomm", dict(compression="topk", topk_ratio=0.01, attach=True)),
    "lowrank+m": ("hetcomm", dict(compression="lowrank", matrix_approximation_rank=4, attach=True)),
    "onebit-no-ef": ("hetcomm", dict(compression="onebit", error_feedback=False)),
    "topk-no-ef": ("hetcomm", dict(compression="topk", topk_ratio=0.01, error_feedback=False)),
}
DEFAULT_MODES = ["torch-allreduce", "torch-fp16", "none", "fp16", "onebit", "onebit+m", "topk", "topk+m"]


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


def _register(ddp, mode: str, state_kwargs: Optional[dict], opt: torch.optim.Optimizer):
    kind, spec = MODES[mode]
    if kind == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.allreduce_hook if spec == "allreduce" else default_hooks.fp16_compress_hook
        ddp.register_comm_hook(None, hook)
        return None
    kwargs = dict(spec)
    kwargs.update(state_kwargs or {})
    attach = kwargs.pop("attach", False)
    state = hetcomm.HookState(**kwargs)
    if attach:
        state.attach_optimizer(opt)
    ddp.register_comm_hook(state, hetcomm.hook)
    return state


def _torch_hook_bytes(mode: str, numel: int, world: int) -> int:
    # Ring all-reduce volume of PyTorch's hooks (the convention hetcomm's stats use).
    width = 2 if mode == "torch-fp16" else 4
    return 2 * (world - 1) * numel * width // world if world > 1 else 0


def train_digits(rank: int, world: int, modes: List[str], steps: int = 600, batch: int = 32, lr: float = 0.02,
                 seed: int = 0, state_kwargs: Optional[dict] = None, progress: bool = False) -> Dict[str, dict]:
    """Trains the digits MLP once per mode on an initialised process group.
    Every rank draws its own batches from its shard of the training set.
    Returns {mode: {accuracy, test_loss, step_ms, bytes_per_step, ...}}."""
    x_tr, y_tr, x_te, y_te = load_digits(seed=seed)
    shard = torch.arange(rank, len(y_tr), world)
    results = {}
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        model = make_model(seed)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        state = _register(ddp, mode, state_kwargs, opt)
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
        if state is not None:
            st = state.stats()
            bytes_per_step = st["last_step"]["bytes_sent"]
            state.close()
        else:
            bytes_per_step = _torch_hook_bytes(mode, numel, world)
        times.sort()
        results[mode] = {
            "accuracy": acc,
            "test_loss": loss,
            "step_ms": 1000 * times[len(times) // 2],
            "bytes_per_step": bytes_per_step,
            "fp32_bytes_per_step": _torch_hook_bytes("torch-allreduce", numel, world),
            "params": numel,
            # rank 0's training loss, averaged over windows of steps (for --plot)
            "loss_curve": [[i + len(w), sum(w) / len(w)] for i in range(0, steps, window)
                           for w in [losses[i:i + window]]],
        }
        dist.barrier()
    return results


def _worker(rank: int, world: int, tmp: str, out: str, modes: List[str], steps: int, batch: int,
            lr: float) -> None:
    torch.set_num_threads(1)
    # Rendezvous through a file (no listening store socket); gloo's own
    # sockets on the loopback interface only.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank,
                            world_size=world)
    try:
        res = train_digits(rank, world, modes, steps=steps, batch=batch, lr=lr, progress=True)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def format_table(results: Dict[str, dict], world: int) -> str:
    lines = [f"{'mode':<16} {'accuracy %':>10} {'test loss':>10} {'bytes/step':>12} {'vs fp32':>8} {'step ms':>8}"]
    for mode, r in results.items():
        ratio = r["fp32_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("nan")
        lines.append(f"{mode:<16} {r['accuracy']:>10.2f} {r['test_loss']:>10.4f} {r['bytes_per_step']:>12,d} "
                     f"{ratio:>7.1f}x {r['step_ms']:>8.2f}")
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
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_worker, args=(ranks, tmp, out, modes, steps, batch, lr), nprocs=ranks)
        with open(out) as f:
            results = json.load(f)
    print(format_table(results, ranks))
    from .benchmarks import common

    common.write_json(json_path, {"ranks": ranks, "steps": steps, "batch": batch, "lr": lr, "results": results},
                      common.metadata(ranks, steps=steps, batch=batch, lr=lr))
    if png_path and plot(results, png_path, ranks):
        print(f"# loss curves and step times: {png_path}")
    return results

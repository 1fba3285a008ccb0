"""Small models, deterministic data and training loops shared by the DDP
tests. The same bodies run on the CPU and, with device="cuda", on the GPUs
(see the `place` fixture in conftest.py)."""

import os
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm

IN, OUT = 32, 10


def mlp(seed: int = 0, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, OUT))


def rank_device(rank: int, device: str = "cpu") -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")


def ddp(model: nn.Module, rank: int, device: str = "cpu", **kwargs) -> DDP:
    """DDP of ``model`` on this rank's device (its GPU for device="cuda")."""
    dev = rank_device(rank, device)
    if dev.type == "cuda":
        return DDP(model.to(dev), device_ids=[dev.index], **kwargs)
    return DDP(model, **kwargs)


def batch(rank: int, step: int, size: int):
    g = torch.Generator().manual_seed(100_003 * step + rank)
    return torch.randn(size, IN, generator=g), torch.randint(0, OUT, (size,), generator=g)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]).cpu()


def full_batch_grad(params: torch.Tensor, batches, hidden: int = 64) -> torch.Tensor:
    """The single-process reference: the gradient of the mean loss over all
    ``batches`` ((x, y) pairs: every rank's) of ``mlp(hidden=hidden)`` at the
    flat ``params``."""
    model = mlp(hidden=hidden)
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    xs, ys = zip(*batches)
    nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    return flat_grads(model)


def train_step(ddp, opt, rank, step, size, state=None, before_step=None):
    """One step; ``before_step()`` runs between backward and the optimizer's step (clipping)."""
    x, y = batch(rank, step, size)
    dev = next(ddp.parameters()).device
    if state is not None:
        state.set_local_batch_size(size)
    opt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(ddp(x.to(dev)), y.to(dev)).backward()
    if before_step is not None:
        before_step()
    opt.step()


def replicas(rank: int, world: int, mode: str, steps: int, device: str = "cpu", options=None) -> dict:
    """``steps`` of SGD-momentum on a DDP MLP in several buckets with
    HookState(mode, **options): this rank's parameters, stats and residual keys."""
    model = mlp(hidden=128)
    net = ddp(model, rank, device, bucket_cap_mb=0.02)
    state = hetcomm.HookState(mode, min_compress_numel=1000, topk_ratio=0.05, **(options or {}))
    net.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        train_step(net, opt, rank, step, 16)
    return {"params": flat_params(model), "stats": state.stats(),
            "residuals": sorted(state.state_dict()["residuals"])}


def kill_rank1_then_time_error(ddp, opt, rank):
    """Three steps, then rank 1 dies without a word; the others train on and
    return the error they got and how long it took (None: no error)."""
    for step in range(3):
        train_step(ddp, opt, rank, step, 8)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        for step in range(3, 10):
            train_step(ddp, opt, rank, step, 8)
    except Exception as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


def first_error(ddp, opt, rank, state=None):
    """The error of one training step on this rank (DDP re-raises the hook's), or None."""
    try:
        train_step(ddp, opt, rank, 0, 8, state)
    except Exception as e:
        return str(e)
    return None


def fixed_rank(mode: str) -> dict:
    """HookState options for ``mode``'s tests of shorter runs than lowrank's
    first share window: lowrank at rank 4, fixed (left to its default it runs
    rank 16 until it chooses, at step 30)."""
    return {"matrix_approximation_rank": 4} if mode == "lowrank" else {}

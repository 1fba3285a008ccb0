"""Small models and deterministic data shared by the DDP tests."""

import torch
from torch import nn

IN, OUT = 32, 10


def mlp(seed: int = 0, hidden: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, OUT))


def batch(rank: int, step: int, size: int):
    g = torch.Generator().manual_seed(100_003 * step + rank)
    return torch.randn(size, IN, generator=g), torch.randint(0, OUT, (size,), generator=g)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])


def train_step(ddp, opt, rank, step, size, state=None):
    x, y = batch(rank, step, size)
    if state is not None:
        state.set_local_batch_size(size)
    opt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()

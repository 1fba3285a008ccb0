"""The optimizer(s) a HookState follows (``attach_optimizer``,
``follow_lr``): one, or several given together (a GAN's generator and
discriminator in one DDP model), held weakly and read as one where there
are several; what the arguments may be."""

from __future__ import annotations

import weakref
from typing import List

import torch


def unwrapped(optimizer):
    """The torch optimizer a framework's wrapper steps (Hugging Face
    Accelerate's ``AcceleratedOptimizer`` holds it as ``.optimizer``): the
    hook reads the momentum and the rates from the optimizer itself."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and type(optimizer).__name__ == "AcceleratedOptimizer":
        return inner
    return optimizer


class Optimizers:
    """The optimizer(s) a HookState follows (``attach_optimizer``,
    ``follow_lr``), held weakly and called as a weak
    reference is: the optimizer, or where several were given (a GAN's
    generator and discriminator in one DDP model) a :class:`Joined` view of
    them; None once one is gone."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self._refs = tuple(weakref.ref(o) for o in optimizers)

    def __len__(self) -> int:
        return len(self._refs)

    def __call__(self):
        opts = [r() for r in self._refs]
        return None if any(o is None for o in opts) else opts[0] if len(opts) == 1 else Joined(opts)

    def same(self, optimizers: List[torch.optim.Optimizer]) -> bool:
        """Whether these are ``optimizers``, in their order."""
        return len(self._refs) == len(optimizers) and all(r() is o for r, o in zip(self._refs, optimizers))


class _JoinedState:
    """Several optimizers' ``state`` read as one (``get`` only: each
    parameter's entry from the optimizer that has one, none made)."""

    def __init__(self, opts) -> None:
        self._maps = [o.state for o in opts]

    def get(self, param, default=None):
        for m in self._maps:
            if param in m:
                return m[param]
        return default


class Joined:
    """Several optimizers whose parameters share a DDP model, read as one:
    their ``param_groups`` in turn, their ``state`` joined; :meth:`each`
    asks a question of each parameter's own optimizer."""

    def __init__(self, opts) -> None:
        self.optimizers = opts
        self.param_groups = [g for o in opts for g in o.param_groups]
        self.state = _JoinedState(opts)

    def each(self, params, ask) -> list:
        """``ask(optimizer, its parameters)`` (a list, one per parameter) of
        each optimizer for the ``params`` it holds; in ``params``' order, None
        for a parameter none holds."""
        out: list = [None] * len(params)
        for o in self.optimizers:
            own = {id(p) for g in o.param_groups for p in g["params"]}
            at = [i for i, p in enumerate(params) if p is not None and id(p) in own]
            if at:
                for i, v in zip(at, ask(o, [params[i] for i in at])):
                    out[i] = v
        return out


def optimizer_list(optimizer, who: str) -> List[torch.optim.Optimizer]:
    """``optimizer`` (one, or a list or tuple of several) as a list of the
    torch optimizers they are (:func:`unwrapped`); a ValueError
    where the list is empty or a parameter is in two of them."""
    many = isinstance(optimizer, (list, tuple))
    opts = [unwrapped(o) for o in (optimizer if many else [optimizer])]
    if not opts:
        raise ValueError(f"{who}: optimizer must be an optimizer or a non-empty list of optimizers, got []")
    seen: dict = {}
    for i, o in enumerate(opts):
        groups = getattr(o, "param_groups", None)
        if not isinstance(groups, list) or not groups or not all(
                isinstance(g, dict) and "params" in g and isinstance(g.get("lr"), (int, float, torch.Tensor))
                for g in groups):
            raise ValueError(f"optimizer{f'[{i}]' if many else ''} must be a torch.optim.Optimizer whose "
                             f"param_groups each have an 'lr', got {type(o).__name__}")
        for p in (p for g in groups for p in g["params"]):
            if seen.setdefault(id(p), i) != i:
                raise ValueError(f"{who}: a parameter (shape {tuple(p.shape)}) is in optimizer[{seen[id(p)]}] and "
                                 f"optimizer[{i}]: each parameter's momentum and rate are read from the one "
                                 f"optimizer that steps it")
    return opts

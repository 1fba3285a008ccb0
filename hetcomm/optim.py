"""``hetcomm.optim.AdamW``: AdamW for compressed momentum.

Attached to a HookState (``state.attach_optimizer(opt)``), the hook compresses
Adam's first moment (1-bit Adam's scheme) and reduces the gradient exactly in
fp32 on the steps ``start_iter + 2**j - 1`` and every ``exact_every``-th step
(16 by default). This optimizer updates the variance (second moment) on those
exact steps only (the doublings alone, a few dozen samples per coordinate,
cost a point of accuracy on digits; README "Limits"): a compressed step's
gradient carries the codec's error, about 1 / (1 - beta1) times the gradient
for onebit, which squared into the variance shrinks every step. Between
updates the variance is frozen; an update after ``k`` steps decays it by
``beta2 ** k``, so it keeps Adam's time constant, and its bias correction counts
the steps it covers.

A frozen variance can be zero where the compressed momentum is not (a ReLU unit
that was dead on every exact step): ``variance_floor`` keeps each tensor's
per-coordinate variance at least that fraction of the tensor's mean, so the
step there stays bounded (without it such a run diverges at the first
compressed step).

Unattached it is AdamW: every step updates the variance and no floor applies;
it matches ``torch.optim.AdamW(foreach=False)`` up to float rounding (tested).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch


class AdamW(torch.optim.Optimizer):
    r"""AdamW whose variance only exact gradients update (see the module).

    Args: ``torch.optim.AdamW``'s ``params, lr, betas, eps, weight_decay``
    (``amsgrad``, ``maximize``, ``foreach``, ``fused``, sparse gradients and
    complex parameters are not supported), and ``variance_floor`` (>= 0,
    applied only when attached).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, variance_floor: float = 0.1) -> None:
        for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("variance_floor", variance_floor)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                                      weight_decay=float(weight_decay), variance_floor=float(variance_floor)))
        #: Set by HookState.attach_optimizer: whether the step being applied
        #: was reduced exactly (None: unattached, every step is).
        self._exact: Optional[Callable[[], bool]] = None

    def __setstate__(self, state: dict) -> None:
        """Also what ``load_state_dict`` restores through: a state saved by
        ``torch.optim.AdamW`` (or ``Adam`` with decoupled weight decay, or
        none), as a run switching to this optimizer resumes it. Each group
        takes this optimizer's ``variance_floor`` where it has none, and
        torch's variance, updated every step, covers every step taken; what
        this optimizer cannot do (amsgrad, maximize, Adam's weight decay
        added to the gradient) is a ValueError naming it, not a change of
        method."""
        super().__setstate__(state)
        for i, group in enumerate(self.param_groups):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"hetcomm.optim.AdamW: the loaded state's param_groups[{i}] has {flag}=True, "
                                     "which this optimizer does not support (keep the optimizer that saved it)")
            if group.get("decoupled_weight_decay") is False and group.get("weight_decay", 0.0) != 0.0:
                raise ValueError(
                    f"hetcomm.optim.AdamW: the loaded state's param_groups[{i}] is torch.optim.Adam's, whose "
                    f"weight_decay ({group['weight_decay']}) is added to the gradient; this optimizer decays the "
                    "weights (AdamW): keep the optimizer that saved it, or save it with weight_decay=0")
            group.setdefault("variance_floor", self.defaults.get("variance_floor", 0.1))
        for st in self.state.values():
            if "step" in st and "variance_step" not in st:
                st["step"] = torch.tensor(float(st["step"]))  # (on the CPU, as this optimizer keeps it)
                st["variance_step"] = st["step"].clone()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        attached = self._exact is not None
        exact = not attached or self._exact()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            # the parameters that share a device, dtype and step counts go through multi-tensor (foreach)
            # kernels together: the same per-element arithmetic as a loop over them (bit for bit on the CPU,
            # tested), about a dozen launches a step plus two a parameter for the attached floor (its mean
            # and maximum) instead of about ten a parameter
            batches: Dict[tuple, List[tuple]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse or torch.is_complex(p):
                    raise ValueError("hetcomm.optim.AdamW: sparse gradients and complex parameters are not supported")
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["variance_step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t, last = int(st["step"].item()), int(st["variance_step"].item())
                batches.setdefault((p.device, p.dtype, t, last), []).append((p, grad, st))
            for (_, _, t, last), batch in batches.items():
                params, grads, states = (list(x) for x in zip(*batch))
                exp_avgs = [st["exp_avg"] for st in states]
                torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
                torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
                if exact or last == 0:
                    decay = beta2 ** (t - last)
                    exp_avg_sqs = [st["exp_avg_sq"] for st in states]
                    torch._foreach_mul_(exp_avg_sqs, decay)
                    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - decay)
                    for st in states:
                        st["variance_step"].fill_(t)
                torch._foreach_addcdiv_(params, exp_avgs, self._denominators(states, group, attached),
                                        value=-lr / (1.0 - beta1 ** t))
        return loss

    @staticmethod
    def _denominators(states: List[dict], group, attached: bool) -> List[torch.Tensor]:
        """What a step divides each (bias-corrected) first moment by, for the
        parameters' ``states`` (one device and dtype; on a GPU without a host
        sync): the square root of the bias-corrected variance, floored when
        attached, plus eps."""
        exp_avg_sqs = [st["exp_avg_sq"] for st in states]
        roots = torch._foreach_sqrt(exp_avg_sqs)
        if attached and group["variance_floor"] > 0.0:
            # a tenth (variance_floor) of each tensor's mean variance, as a Python float would compute it: the
            # float32 mean's root times sqrt(floor) in double, rounded to the tensor's dtype
            means = torch.stack([v.mean() for v in exp_avg_sqs])
            lows = (means.sqrt().double() * math.sqrt(group["variance_floor"])).to(means.dtype)
            torch._foreach_maximum_(roots, list(lows.unbind()))
        # the bias correction of the steps each variance covers
        torch._foreach_div_(roots, [math.sqrt(1.0 - group["betas"][1] ** int(st["variance_step"].item()))
                                    for st in states])
        torch._foreach_add_(roots, group["eps"])
        return roots

    @staticmethod
    def _denominator(st, group, attached: bool) -> torch.Tensor:
        """:meth:`_denominators` of one parameter's state."""
        return AdamW._denominators([st], group, attached)[0]


def variance_version(optimizer: torch.optim.Optimizer, param: torch.Tensor):
    """Changes whenever the variance an Adam divides ``param``'s update by
    may have changed (hetcomm's AdamW: on its exact steps; torch's Adam: every
    step; a loaded state_dict: new tensors); None before its first step."""
    st = optimizer.state.get(param)
    if not st or "exp_avg_sq" not in st:
        return None
    sq = st["exp_avg_sq"]
    return id(sq), sq._version, int(st["variance_step" if "variance_step" in st else "step"].item())


def update_denominators(optimizer: torch.optim.Optimizer, params) -> list:
    """For each of ``params``: the tensor that ``optimizer``'s next step
    divides its bias-corrected first moment by (hetcomm's :class:`AdamW`, as
    its step computes it; ``torch.optim.Adam`` / ``AdamW``: the square root of
    the bias-corrected variance, amsgrad's maximum where on, plus eps); None
    for a parameter without state yet. An attached HookState's top-k ranks the
    momentum's entries by the update they make, ``|m| / denominator``."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for p in params:
        st, group = optimizer.state.get(p), groups.get(id(p))
        if not st or "exp_avg_sq" not in st or group is None:
            out.append(None)
        elif isinstance(optimizer, AdamW):
            out.append(AdamW._denominator(st, group, optimizer._exact is not None))
        else:
            sq = st["max_exp_avg_sq"] if group.get("amsgrad") else st["exp_avg_sq"]
            bias2_sqrt = math.sqrt(1.0 - group["betas"][1] ** float(st["step"]))
            out.append((sq.sqrt() / bias2_sqrt).add_(group["eps"]))
    return out


__all__ = ["AdamW"]

"""Each parameter's own step: the steps in which it required a gradient.

HookState's schedule of exact steps is for the optimizer of a bucket's
parameters: ``start_iter``'s first steps (an Adam's second moment set from
the true gradient), attach_optimizer's warm-up, an attached Adam's steps
``start_iter + 2**j - 1`` and every ``exact_every``-th. Counted in DDP's
steps (backward passes), a parameter switched off in some of them
(``requires_grad=False``: Lightning's ``toggle_optimizer`` switches off the
parameters of the optimizer that is not stepping, a GAN's discriminator
while its generator steps; a layer frozen for a while) took its first step
compressed: in a toggled GAN with both models in one DDP model and Adam, the
discriminator's first step was DDP's second, and ended 2-4x as far off
fp32's path as with a DDP model each (bench/README "Each parameter's own
step").

:class:`OwnSteps` counts, per parameter, the steps its bucket was reduced
while it was switched off. A bucket's own step is the global step less the
most steps any of its switched-on parameters spent switched off: the step
its least-stepped optimizer is at. The schedule reads that step. In a model
whose parameters stay switched on (or frozen: a parameter that is off does
not count) it is the global step, and nothing changes.

Every rank must plan a bucket alike. ``requires_grad`` is this rank's, so
where a bucket's own step makes its plan depart from the global step's (a
switched-on parameter's first steps, an Adam's exact steps of its own), the
ranks compare that plan through the default group's store before the bucket
goes out: ranks whose parameters require gradients differently get a clear
error within the group's timeout, not a wire of one kind meeting another.
A toggled GAN compares a few buckets in a run (the discriminator's first
step; with an Adam attached, about log2 of its steps).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist


class OwnSteps:
    """See the module."""

    def __init__(self) -> None:
        self._off: Dict[int, int] = {}  # parameter number -> the steps its bucket was reduced while it was off
        self.compared = 0  # the buckets whose plan the ranks compared

    def step(self, sig: Sequence[int], param_of: Callable[[int], Optional[torch.Tensor]], step: int) -> int:
        """The own step of the bucket of parameters ``sig`` at global step
        ``step`` (its parameters' steps switched off counted now)."""
        lag, off = 0, self._off
        for n in sig:
            p = param_of(n)
            if p is None:
                continue
            if p.requires_grad:
                lag = max(lag, off.get(n, 0))
            else:
                off[n] = off.get(n, 0) + 1
        return step - lag

    def agree(self, group: dist.ProcessGroup, what: str, plan: str, timeout: Optional[timedelta]) -> None:
        """Raises unless every rank of ``group`` planned ``what`` (a step and
        a bucket) as ``plan``: each rank posts its plan to the default
        group's store and reads the others'."""
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        # numbered by this state's comparisons (the same on ranks that agree), not by step: a state loaded back
        # to an earlier step meets no key of its own from before
        prefix = f"hetcomm/own_steps/{group.group_name}/{self.compared}/"
        self.compared += 1
        mine = f"{plan} {what}"
        store.set(prefix + str(me), mine)
        wait = timeout or timedelta(minutes=30)
        for r in ranks:
            if r == me:
                continue
            try:
                store.wait([prefix + str(r)], wait)
            except Exception as e:  # (the store's timeout error, or its connection's)
                raise RuntimeError(
                    f"hetcomm: at step/bucket {what} this rank (global rank {me}) planned its bucket from its own "
                    f"step ({_NAMES.get(plan, plan)}), which departs from the global step's because some of its "
                    f"parameters were switched off (requires_grad=False) in earlier steps; global rank {r} did not "
                    f"plan it so within {wait}: the ranks' parameters require gradients differently. Switch "
                    "parameters on and off alike on every rank (as Lightning's toggle_optimizer does)") from e
            theirs = store.get(prefix + str(r)).decode()
            if theirs != mine:
                plan_r, _, what_r = theirs.partition(" ")
                raise RuntimeError(
                    f"hetcomm: at step/bucket {what} this rank (global rank {me}) planned its bucket as "
                    f"{_NAMES.get(plan, plan)}, global rank {r} planned {_NAMES.get(plan_r, plan_r)} at step/bucket "
                    f"{what_r} where the global step's plan did not hold: the ranks' parameters "
                    "require gradients differently (requires_grad=False on some ranks only). Switch parameters on "
                    "and off alike on every rank (as Lightning's toggle_optimizer does)")

    def state_dict(self) -> Dict[str, int]:
        return {str(n): k for n, k in self._off.items()}

    def load_state_dict(self, off: Optional[Dict]) -> None:
        self._off = {int(n): int(k) for n, k in (off or {}).items()}


_NAMES = {"c": "compressed", "w": "the warm-up's wire", "x": "exact"}

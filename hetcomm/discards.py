"""A reduced gradient that no optimizer stepped: the warning that names the fix.

Error feedback assumes every gradient it reduces is applied: what a step's
message did not carry (and the repayment of earlier steps' errors it did)
is owed to the next steps. A loop that reduces a backward through the DDP
model and then throws the gradient away breaks that: a GAN's generator
step through the discriminator's DDP model (the discriminator's gradient
zeroed before its own step), a batch skipped after its backward. What the
thrown-away message owed, and what it repaid, goes into the following
steps' gradient. Measured on a toy GAN's discriminator (2 gloo ranks, SGD
with momentum, 60 steps; bench/README "A gradient thrown away after its
exchange"): with int3 its weights ended 5.7x as far from fp32's as fp32's
moved in all, 2.4x with lowrank, 4.3x with PyTorch's PowerSGD hook; with
the generator's step under ``ddp.no_sync()``, 0.009x, as without it.

:class:`DiscardWatch` notes a parameter of each step's first bucket that
feeds such state (a residual, a carry, the attached momentum), one that
requires a gradient (Lightning's ``toggle_optimizer`` switches the other
model's off, and no optimizer steps those that step), and watches
every optimizer's step (global step pre- and post-hooks, from the state's
creation): where the next step begins and no optimizer holding that
parameter stepped in between (or was stepping as the bucket went by: a
closure's backward, LBFGS's or Lightning's) and the parameter was not
updated in place either (its version counter: a hand-written step without
an optimizer), it warns once. Accumulating
gradients without ``no_sync`` reads the same (the exchanges are then wasted,
not wrong), and the warning says so. A step whose gradient was not finite is
left out: it left the state untouched, and GradScaler skips the optimizer's
step after it.

A parameter that no rank used in a step (switched off by ``toggle_optimizer``
in one DDP model, or unused under ``find_unused_parameters=True``) keeps its
gradient as it was: DDP does not write the reduced bucket back there. Its
slots of the state are put back as they were before the step instead
(hetcomm.unused), so nothing is lost and nothing is warned of.
"""

from __future__ import annotations

import logging
import weakref
from typing import Iterable, List, Optional

import torch

from . import step_hooks

log = logging.getLogger("hetcomm")


class DiscardWatch:
    """See the module."""

    def __init__(self) -> None:
        self.warned = False
        self._param: Optional[weakref.ref] = None  # a parameter of the noted step's first stateful bucket
        self._step = -1
        self._nonfinite = 0  # the engine's count of non-finite steps when the last step began
        self._noted_from = 0  # ... and when the noted one began
        self._what = ""
        self._stepped = False  # an optimizer holding it stepped since
        self._version = 0  # its version counter when noted: an update in place (a hand-written step) moves it
        self._inside: List[weakref.ref] = []  # the optimizers whose step() runs now (a closure's backward)
        # every optimizer's step, from the start (a closure's first backward runs inside the first step)
        step_hooks.listen(self, pre=True, post=True)

    def _pre_step(self, optimizer) -> None:
        self._inside.append(weakref.ref(optimizer))
        param = self._param() if self._param is not None else None
        if param is not None and not self._stepped:
            self._stepped = _holds(optimizer, param)

    def _post_step(self, optimizer) -> None:
        self._inside = [o for o in self._inside if o() is not optimizer and o() is not None]

    def see(self, step: int, params: Iterable[Optional[torch.Tensor]], what: str) -> None:
        """A bucket of step ``step`` whose state its gradient feeds: notes a
        parameter of it that requires a gradient (:meth:`note`; one that does
        not, switched off by ``toggle_optimizer``, no optimizer steps)."""
        if self.wants(step):
            self.note(step, next((q for q in params if q is not None and q.requires_grad), None), what)

    def wants(self, step: int) -> bool:
        """Whether a bucket of step ``step`` is still to be noted (one a step)."""
        return not self.warned and self._step != step

    def note(self, step: int, param: Optional[torch.Tensor], what: str) -> None:
        """Step ``step`` reduced a bucket holding ``param`` whose state its gradient feeds (``what``: the plan).
        Inside an optimizer's step that holds it (a closure's backward: LBFGS, Lightning) it is consumed there."""
        if not self.wants(step) or param is None:
            return
        self._param, self._step, self._noted_from, self._what = weakref.ref(param), step, self._nonfinite, what
        self._version = param._version
        self._stepped = any(o() is not None and _holds(o(), param) for o in self._inside)

    def check(self, step: int, nonfinite: int) -> None:
        """At step ``step``'s first bucket (``nonfinite``: the engine's count of
        non-finite steps, the step before done): warns once if the step before
        fed error feedback, was finite and no optimizer stepped its parameters since."""
        self._nonfinite = nonfinite
        if self._param is None:
            return
        param, noted, self._param = self._param(), self._step, None
        if param is None or param._version != self._version:  # gone, or updated in place since
            return
        if self.warned or self._stepped or noted != step - 1 or nonfinite > self._noted_from:
            return
        self.warned = True
        self.close()
        log.warning(
            "hetcomm: step %d reduced buckets with error feedback (%s) and step %d began before any optimizer "
            "stepped their parameters. If step %d's gradient was thrown away (a GAN's generator step through the "
            "discriminator's DDP model, a skipped batch), what its compressed message owed and repaid went into "
            "the next steps' gradient: run such a backward under ddp.no_sync() or through ddp.module (no exchange "
            "at all). If you accumulate gradients over micro-batches, ddp.no_sync() on all but the last saves "
            "their exchanges. (Warned once.)", noted, self._what, step, noted)

    def close(self) -> None:
        step_hooks.leave(self)
        self._inside = []


def _holds(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    return any(q is param for group in optimizer.param_groups for q in group["params"])

"""Error feedback of a parameter this rank gave no gradient: held back, not lost.

DDP reduces every bucket whole. A parameter that this rank's backward did not
reach (``find_unused_parameters=True``: a branch not taken, another task's
head; Lightning's ``toggle_optimizer``, which switches the other optimizer's
parameters off) sits in its bucket as its ``.grad`` stands (zero, or None:
zeros), and where no rank used it DDP does not write the reduced bucket back
into its ``.grad`` at all. What the hook's message repaid of its error
feedback into that slot was then lost: a toy GAN with both models in one DDP
model ran 7-12x as far off fp32's path as with a DDP model each (bench/README
"A gradient thrown away after its exchange").

:class:`UnusedParams` holds such a parameter's residual (and carry) back for
the step: its slots of the residual are zeroed before the bucket goes to the
engine and added back once the reduction is done, so the slot's message
carries just the gradient as DDP found it (a zero, which the codecs send
exactly). What the codec missed of it is kept as ever; onebit, whose zero is
sent as +scale where its 32-entry chunk holds another parameter's entries,
keeps only what was held (the sign it sent for a zero is not owed: where no
rank used the parameter nothing of it was applied). The debt is repaid at the
first step this rank uses the parameter again.

Which parameters a backward reached: a hook on each parameter's gradient
(registered the first time its bucket feeds a residual held here; tensor
hooks run before DDP's), consumed when its bucket is reduced; a parameter
that does not require a gradient now reached none. In the step that
registers the hooks every parameter that requires a gradient counts as
reached.

A server's residual (the two-phase codecs on three or more ranks: what this
rank, summing a segment of the bucket, missed of the sum) is held the same way,
by this rank's use: where no rank used the parameter every message's slot was
an exact zero and so is the sum, and the residual keeps what it held; where
others did, it adds what it missed of their sum to what it held. So is a
hierarchical plan's residual, of this rank's shard of its node's sum: where
this rank did not use a parameter and a rank of its node did, the node's sum
is sent and what the codec missed of it is added to what was held (only the
repayment waits for this rank's next use). A hierarchical plan's carry (of
the whole bucket, summed within the node) is not held.

Left as before: buckets under the attached momentum (the optimizer's
momentum of a skipped parameter is not the hook's to hold).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .bucket_keys import offset_in


class UnusedParams:
    """See the module."""

    def __init__(self) -> None:
        self._reached: set = set()  # parameter numbers whose gradient a backward computed since their last bucket
        self._hooked: Dict[int, object] = {}  # parameter number -> its hook's handle

    def _watch(self, n: int, param: torch.Tensor) -> bool:
        """Hooks ``param`` (number ``n``) if it is not yet; whether it was already."""
        if n in self._hooked:
            return True
        ref = weakref.ref(self)

        def reached(grad, n=n):
            me = ref()
            if me is not None:
                me._reached.add(n)

        self._hooked[n] = param.register_hook(reached)
        return False

    def unused(self, sig: Sequence[int], param_of: Callable[[int], Optional[torch.Tensor]]) -> List[int]:
        """The positions in bucket signature ``sig`` of parameters this rank's
        backward did not reach since their last bucket; forgets the rest."""
        reached, out = self._reached, []
        for i, n in enumerate(sig):
            if n in reached:
                reached.discard(n)
                continue
            p = param_of(n)
            if p is None:
                continue
            if not p.requires_grad:
                out.append(i)
            elif self._watch(n, p):  # hooked before this backward, and not reached
                out.append(i)
        return out

    def forget(self, sig: Sequence[int]) -> None:
        """A bucket reduced without :meth:`unused` (a dense or hierarchical
        plan, a join's shadow): its parameters' marks are spent."""
        if self._reached:
            self._reached.difference_update(sig)

    def hold(self, grads: Sequence[torch.Tensor], buffer: torch.Tensor, positions: Sequence[int],
             residual: torch.Tensor, carry: Optional[torch.Tensor] = None,
             base: int = 0) -> List[Tuple[int, int, torch.Tensor]]:
        """Zeroes the slots of the parameters at ``positions`` (of the bucket's
        ``grads``, views of ``buffer``) in ``residual``, which covers the
        bucket's entries from ``base`` on (a server's segment; what lies
        outside it is not its), and in the whole bucket's ``carry``, which
        the residual then owes; returns (offset in the residual, numel, what
        was held) for :meth:`give_back`."""
        held = []
        end = base + residual.numel()
        for i in positions:
            g = grads[i]
            start = offset_in(g, buffer)  # (an empty gradient's lo >= hi below, wherever it points)
            lo, hi = max(start, base), min(start + g.numel(), end)
            if lo >= hi:
                continue
            slot = residual.narrow(0, lo - base, hi - lo)
            owed = slot.clone()
            slot.zero_()
            if carry is not None:
                c = carry.narrow(0, lo, hi - lo)
                owed.add_(c)
                c.zero_()
            held.append((lo - base, hi - lo, owed))
        return held

    @staticmethod
    def give_back(residual: torch.Tensor, held: Sequence[Tuple[int, int, torch.Tensor]], keep_new: bool) -> None:
        """After the reduction: the held slots owe what they held, plus (``keep_new``) what the codec missed of
        the slot's message."""
        for off, n, owed in held:
            slot = residual.narrow(0, off, n)
            if keep_new:
                slot.add_(owed)
            else:
                slot.copy_(owed)

    def close(self) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked, self._reached = {}, set()

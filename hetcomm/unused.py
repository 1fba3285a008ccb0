"""A parameter that no rank used in a step: its step of error feedback undone.

DDP reduces every bucket whole. A parameter that this rank's backward did not
reach (``find_unused_parameters=True``: a branch not taken, another task's
head; Lightning's ``toggle_optimizer``, which switches the other optimizer's
parameters off) sits in its bucket as its ``.grad`` stands (zero, or None:
zeros). Where another rank used it, DDP writes the reduced slot into its
``.grad`` on every rank and the optimizer applies it: the hook's message for
it was an ordinary one. Where no rank used it, DDP writes nothing back: what
the message repaid of the slot's error feedback, and what the attached
momentum's slot decayed by, was lost (a toy GAN with both models in one DDP
model ran 7-12x as far off fp32's path as with a DDP model each; bench/README
"A gradient thrown away after its exchange").

:class:`UnusedParams` keeps, for each parameter this rank's backward did not
reach, its slots of the bucket's state as they were before the step (the
residual, the carry, the server's segment, the attached momentum, and
lowrank's Q of its matrix, whose power iteration on the residual alone turned
the warm start away from the gradient's subspace). After DDP's
end of backward (an autograd final callback queued behind DDP's own), where
DDP left the parameter's ``.grad`` as it was (None, or a tensor whose version
did not move), no rank used it, and every rank puts those slots back: the
step never happened for it, as for the optimizer, which skips a parameter
without a gradient. Where DDP wrote it, the slots stay as the reduction left
them.

Every rank sees the same: DDP's choice is a global one (it all-reduces which
parameters were used), so the undo is the same on every rank, and a codec
whose state mixes ranks (lowrank's residual is each rank's message less its
share of the approximated sum; a server's residual is what it missed of the
segment's sum) is undone consistently. Holding the slots back before the
step instead (this module's first form) could not know whether another rank
used the parameter: there lowrank's held residual left the other ranks' in
the sum uncancelled (a toy where the ranks took different heads each step
ran 7-12x as far off fp32's path), and under the attached momentum the
message of an unused slot is beta m, whose codec error is owed where another
rank used it and must be dropped where none did.

Which parameters a backward reached: a hook on each parameter's gradient
(registered the first time its bucket feeds state; tensor hooks run before
DDP's), consumed when its bucket is reduced; a parameter that does not
require a gradient now reached none. In the step that registers the hooks
every parameter that requires a gradient counts as reached. A parameter
whose ``.grad`` is a view of the bucket (``gradient_as_bucket_view=True``
once it has one) is left out: whatever the hook writes to its slot is its
gradient, and the optimizer applies it.
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .bucket_keys import offset_in

#: (a parameter, its .grad's version when the bucket went by, or None where it had none, the slots kept:
#: (state tensor, offset, numel, values before the step))
_Pending = Tuple[weakref.ref, Optional[int], List[Tuple[torch.Tensor, int, int, torch.Tensor]]]


def _queue(callback: Callable[[], None]) -> None:
    """Runs ``callback`` at the end of the backward running now."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class UnusedParams:
    """See the module."""

    def __init__(self) -> None:
        self._reached: set = set()  # parameter numbers whose gradient a backward computed since their last bucket
        self._hooked: Dict[int, object] = {}  # parameter number -> its hook's handle
        self._pending: List[_Pending] = []
        self._armed_in: Optional[int] = None  # the backward (autograd graph task) whose end-of-backward check is queued

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
        """A bucket reduced without :meth:`unused` (a plan without state, a
        join's shadow): its parameters' marks are spent."""
        if self._reached:
            self._reached.difference_update(sig)

    def keep(self, params: Sequence[Optional[torch.Tensor]], grads: Sequence[torch.Tensor],
             buffer: torch.Tensor, positions: Sequence[int],
             states: Sequence[Tuple[Optional[torch.Tensor], int]],
             own: Optional[Dict[int, List[Tuple[torch.Tensor, int, int]]]] = None) -> bool:
        """Before a bucket's reduction (its ``params``, their ``grads``, views
        of ``buffer``): keeps the slots of the parameters at ``positions`` in
        each (state, base) of ``states``, a flat tensor covering the bucket's
        entries from ``base`` on (None: none), and the slots ``own`` names per
        position, (state, offset, numel) (lowrank's Q of its matrix), to be
        put back after DDP's end of this backward where no rank used the
        parameter. False outside a backward (a bucket handed over by hand:
        nothing kept)."""
        task = torch._C._current_graph_task_id()
        if task < 0:
            return False
        if self._armed_in != task:  # (what a backward that failed before its end kept is dropped)
            ref = weakref.ref(self)

            def behind_ddp():  # DDP queues its end of backward once its last bucket is ready; this runs after it
                _queue(lambda: (lambda me: me is not None and me._undo())(ref()))

            _queue(behind_ddp)
            self._armed_in, self._pending = task, []
        storage = buffer.untyped_storage().data_ptr()
        for i in positions:
            p, g = params[i], grads[i]
            grad = p.grad if p is not None else None
            if p is None or (grad is not None and grad.untyped_storage().data_ptr() == storage):
                continue  # (a view of the bucket: what the hook writes there is applied)
            start = offset_in(g, buffer)  # (an empty gradient's lo >= hi below, wherever it points)
            kept = []
            for t, base in states:
                if t is None:
                    continue
                lo, hi = max(start, base), min(start + g.numel(), base + t.numel())
                if lo < hi:
                    kept.append((t, lo - base, hi - lo, t.narrow(0, lo - base, hi - lo).clone()))
            for t, off, n in (own or {}).get(i, ()):
                kept.append((t, off, n, t.narrow(0, off, n).clone()))
            if kept:
                self._pending.append((weakref.ref(p), None if grad is None else grad._version, kept))
        return True

    def _undo(self) -> None:
        """After DDP's end of backward: a kept parameter whose ``.grad`` DDP
        left as it was (no rank used it) gets its slots back."""
        pending, self._pending, self._armed_in = self._pending, [], None
        for ref, version, kept in pending:
            p = ref()
            grad = p.grad if p is not None else None
            if p is None or (grad is not None and (version is None or grad._version != version)):
                continue  # DDP wrote it: some rank used it, and the optimizer applies the reduced slot
            for t, off, n, before in kept:
                t.narrow(0, off, n).copy_(before)

    def close(self) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked, self._reached, self._pending = {}, set(), []

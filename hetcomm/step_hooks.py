"""torch's optimizer step hooks (global: every optimizer's ``step``), one
pair registered once per process, calling hetcomm's listeners, held weakly.

Each listener (:class:`hetcomm.discards.DiscardWatch`,
:class:`hetcomm.clip.NormSketch`) once registered hooks of its own and
removed them when closed. A state freed by the garbage collector (a
reference cycle: a DDP model's) closes them at whatever allocation set the
collection off, which can be inside an optimizer's loop over those very
hooks: "OrderedDict mutated during iteration" from ``opt.step()`` (seen in
CI). Listening and leaving change only these weak sets; a listener freed
leaves by itself.
"""

from __future__ import annotations

import weakref

#: Listeners with ``_pre_step(optimizer)``, run before every optimizer's step
_PRE: "weakref.WeakSet" = weakref.WeakSet()
#: Listeners with ``_post_step(optimizer)``, run after it
_POST: "weakref.WeakSet" = weakref.WeakSet()
_REGISTERED = False


def _pre(optimizer, args, kwargs) -> None:
    for listener in list(_PRE):
        listener._pre_step(optimizer)


def _post(optimizer, args, kwargs) -> None:
    for listener in list(_POST):
        listener._post_step(optimizer)


def listen(listener, pre: bool = True, post: bool = False) -> None:
    """Calls ``listener._pre_step`` (and ``_post_step``) at every optimizer step from now on."""
    global _REGISTERED
    if pre:
        _PRE.add(listener)
    if post:
        _POST.add(listener)
    if not _REGISTERED:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_pre)
        register_optimizer_step_post_hook(_post)
        _REGISTERED = True


def leave(listener) -> None:
    """No more calls to ``listener``."""
    _PRE.discard(listener)
    _POST.discard(listener)

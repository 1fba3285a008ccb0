"""Which DistributedDataParallel runs the comm hook: whether every process
group spans the world (then DDP's group must be the HookState's), the DDP
that holds a parameter (found through the garbage collector, once), and the
DDP whose join hook is shadowing the others' backward (``model.join()``)."""

import gc
import sys
import types

import torch
import torch.distributed as dist


def every_group_spans_the_world() -> bool:
    """Whether every process group of this process holds all ranks (False
    when c10d's private registry of groups is not where it was in torch 2.13)."""
    groups = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_group_ranks", None)
    if not isinstance(groups, dict) or not groups:
        return False
    world = dist.get_world_size()
    return all(len(ranks) == world for ranks in groups.values())


def _join_hook_code():
    """The code of DDP's join hook (``_DDPJoinHook.main_hook``), or None where
    torch has no such private class."""
    try:
        from torch.nn.parallel.distributed import _DDPJoinHook
        return _DDPJoinHook.main_hook.__code__
    except (ImportError, AttributeError):
        return None


_JOIN_HOOK_CODE = _join_hook_code()  # looked up once, not at every step


def join_shadowing():
    """The DistributedDataParallel whose join hook runs this call of the comm
    hook, or None: inside ``model.join()`` (torch's ``Join``) a rank whose
    inputs ran out shadows the others' backward by running the hook over
    zero buckets (``_DDPJoinHook.main_hook``, found on this thread's stack)."""
    code = _JOIN_HOOK_CODE
    if code is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return getattr(frame.f_locals.get("self"), "ddp", None)
        frame = frame.f_back
    return None


def owning_ddp(param: torch.Tensor, depth: int = 4):
    """The DistributedDataParallel that holds ``param`` (its module's or its own
    parameter lists), found through the garbage collector's referrers; None if
    there is none within ``depth`` hops. Run once, at the first step."""
    from torch.nn.parallel import DistributedDataParallel

    seen, frontier = {id(param)}, [param]
    for _ in range(depth):
        found: list = []
        # one scan of the heap per level (get_referrers walks every tracked object: ~15-30 ms each)
        for ref in gc.get_referrers(*frontier):
            if isinstance(ref, DistributedDataParallel):
                return ref
            if id(ref) in seen or ref is frontier or ref is found or isinstance(ref, types.FrameType):
                continue
            seen.add(id(ref))
            if isinstance(ref, (dict, list, tuple, torch.nn.Module)):
                found.append(ref)
        if not found:
            return None
        frontier = found
    return None

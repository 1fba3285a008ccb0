"""The DDP communication hook."""


import torch
import torch.distributed as dist

from .state import HookState


def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp.register_comm_hook(state, hetcomm.hook)``.

    Queues the bucket on the state's comm thread and returns at once; the
    Future completes with the reduced bucket (in place) once every rank has
    contributed. Buckets are reduced in the order DDP hands them over, the same
    on every rank. See :class:`HookState` for the options.
    """
    if not isinstance(state, HookState):
        raise ValueError(f"hetcomm.hook: state must be a hetcomm.HookState, got {type(state).__name__}")
    return state._submit(bucket)

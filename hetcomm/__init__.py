"""hetcomm: gradient communication for PyTorch DDP on clusters of mixed GPUs.

    state = hetcomm.HookState(compression="onebit")
    ddp.register_comm_hook(state, hetcomm.hook)

Importing hetcomm never initialises CUDA.
"""

import torch  # noqa: F401  (loads libtorch before the extension, which has no rpath to it)

from . import _C, amp, checkpoint, modes, ops, optim
from .hooks import hook
from .state import HookState

__version__ = "0.1.0"


def build_info() -> dict:
    """What this build contains: ``cuda`` (CUDA kernels linked and usable),
    ``cuda_compiled`` (compiled at least as a check), ``cuda_archs``,
    ``nccl_version`` (the nccl.h it was compiled against) and ``torch_version``."""
    return dict(_C.build_info())


__all__ = ["HookState", "hook", "amp", "checkpoint", "modes", "ops", "optim", "build_info", "__version__"]

"""A :class:`hetcomm.HookState` in ``torch.distributed.checkpoint`` (DCP).

A HookState's ``state_dict()`` is its rank's own (error feedback, compressed
momenta, lowrank's Q) under the same keys on every rank. DCP keeps one copy of
an entry that every rank saves under one key, as it does a replicated model's
weights, so ``dcp.save({"hetcomm": state})`` would keep one rank's state for
all (loading it, the other ranks' states name another rank: a ValueError).
:class:`PerRank` saves each rank's state under a key of its own::

    dcp.save({"model": model.state_dict(), "hetcomm": hetcomm.checkpoint.PerRank(state)}, checkpoint_id=path)
    ...
    dcp.load({"model": model.state_dict(), "hetcomm": hetcomm.checkpoint.PerRank(state)}, checkpoint_id=path)

Resume on as many ranks (each loads its own). On another world size a rank
the saving run lacked has no entry there (DCP's missing-key error): save each
rank's ``state.state_dict()`` with ``torch.save`` for elastic restarts, and
load with ``strict=False`` (:meth:`hetcomm.HookState.load_state_dict`).
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Dict, Optional

import torch


class PerRank:
    """``torch.distributed.checkpoint.stateful.Stateful`` for ``state``: its
    ``state_dict()`` as one entry, ``"rank<r>"`` (r: the state's rank in its
    process group), serialized by ``torch.save`` and read back tensors and
    containers only. ``strict`` goes to ``state.load_state_dict``."""

    def __init__(self, state: Any, *, strict: bool = True) -> None:
        from .state import HookState

        if not isinstance(state, HookState):
            raise ValueError(f"state must be a hetcomm.HookState, got {type(state).__name__}")
        self.state, self.strict = state, strict

    def _key(self) -> str:
        return f"rank{self.state._rank()}"

    def state_dict(self) -> Dict[str, bytes]:
        out = io.BytesIO()
        torch.save(self.state.state_dict(), out)
        return {self._key(): out.getvalue()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        blob = state_dict.get(self._key())
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError(f"hetcomm.checkpoint.PerRank: no {self._key()!r} entry of bytes in the state_dict "
                             f"loaded (keys {sorted(state_dict)}): load what PerRank saved")
        sd = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        self.state.load_state_dict(sd, strict=self.strict)


def read_rank_file(path_of: Callable[[int], str], rank: int) -> Optional[Dict[str, Any]]:
    """The state a framework's checkpoint saved for ``rank`` in the file
    ``path_of(rank)``, or rank 0's where the saving run had no such rank
    (resumed on more processes; load it with ``strict=False``); None where
    neither file exists. Tensors and containers only (torch's safe loader)."""
    for path in (path_of(rank), path_of(0)):
        if os.path.exists(path):
            return torch.load(path, map_location="cpu", weights_only=True)
    return None


__all__ = ["PerRank", "read_rank_file"]

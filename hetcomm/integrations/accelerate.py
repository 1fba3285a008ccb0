"""Hugging Face Accelerate: ``hetcomm.integrations.accelerate.register(accelerator, model, state)``.

After ``model, optimizer, ... = accelerator.prepare(...)`` on several
processes (the model then is a ``DistributedDataParallel``)::

    state = hetcomm.HookState("auto")
    hetcomm.integrations.accelerate.register(accelerator, model, state)
    state.attach_optimizer(optimizer)   # optional (it takes the torch optimizer Accelerate wraps)

registers :func:`hetcomm.hook` on the model and makes Accelerate's
``save_state`` / ``load_state`` carry each rank's hook state: Accelerate saves
what ``register_for_checkpointing`` holds from the main process alone, and a
HookState is each rank's own (error feedback), so it goes to
``<dir>/hetcomm-rank<r>.pt`` from every rank instead (loaded with
``strict=False``: on another number of processes the step count and warm-up
carry on, a rank the saving run lacked taking rank 0's file). Under
``Accelerator(mixed_precision="fp16")`` Accelerate's GradScaler becomes a
:class:`hetcomm.amp.GradScaler` with its settings: torch's hands the hook
gradients times the loss scale (README, "Mixed cluster").
``accelerator.accumulate(model)`` (DDP's ``no_sync``) needs nothing more.
``accelerator.clip_grad_norm_`` clips by the norm of the gradient the ranks
reduced (``state.clip_grad_norm_`` after unscaling), not by the norm of what a
lossy codec handed back (the gradient or momentum plus the error feedback being
repaid: clipping that clips more and harder than fp32 would).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import amp
from ..checkpoint import read_rank_file
from ..hooks import hook
from ..state import HookState


def _rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"hetcomm-rank{rank}.pt")


def register(accelerator: Any, model: Any, state: HookState) -> HookState:
    """Register ``state`` with ``hook`` on Accelerate's prepared ``model`` and
    with ``accelerator``'s checkpoints and loss scaler (module docstring).
    Returns ``state``."""
    if not isinstance(state, HookState):
        raise ValueError(f"state must be a hetcomm.HookState, got {type(state).__name__}")
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"model must be what accelerator.prepare returned on several processes, a "
                         f"DistributedDataParallel, got {type(model).__name__}: on one process there is nothing "
                         f"to reduce (guard hetcomm with `if accelerator.num_processes > 1`)")
    model.register_comm_hook(state, hook)
    rank = accelerator.process_index

    def save(models, weights, output_dir: str) -> None:  # on every process, into the folder each one made
        torch.save(state.state_dict(), _rank_file(output_dir, rank))

    def load(models, input_dir: str) -> None:
        saved = read_rank_file(lambda r: _rank_file(input_dir, r), rank)
        if saved is None:
            raise ValueError(f"hetcomm: {input_dir} holds no hetcomm-rank*.pt: it was saved without "
                             "hetcomm.integrations.accelerate.register (or by another state)")
        # strict=False: on as many processes each rank's own state to the bit; on another number the step count
        # and warm-up carry on and each rank's error feedback starts afresh (as Lightning's strategy loads)
        state.load_state_dict(saved, strict=False)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    _scale_through_hetcomm(accelerator, state)
    _clip_through_hetcomm(accelerator, state)
    return state


def _clip_through_hetcomm(accelerator: Any, state: HookState) -> None:
    """``accelerator.clip_grad_norm_`` (Accelerate's way to clip, and what
    transformers' Trainer calls) clips by the norm of the gradient the ranks
    reduced, ``state.clip_grad_norm_`` (after unscaling, as Accelerate's does),
    not by the norm of what a lossy codec handed back."""
    if getattr(accelerator, "_hetcomm_clip", None) is state:
        return

    def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0):
        accelerator.unscale_gradients()
        # (max_norm inf, the norm alone: transformers' Trainer reads it so every step, to log it, clipping off)
        return state.clip_grad_norm_(list(parameters), max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator._hetcomm_clip = state


def _scale_through_hetcomm(accelerator: Any, state: HookState) -> None:
    """fp16: Accelerate's torch GradScaler, held by the accelerator and by each
    prepared optimizer, becomes a hetcomm.amp.GradScaler with its settings
    (its state, saved by ``save_state``, loads into it as into torch's)."""
    held = getattr(accelerator, "scaler", None)
    if held is None or isinstance(held, amp.GradScaler) or not held.is_enabled():
        return
    scaler = amp.GradScaler.taking_over(state, held, accelerator.device, "fp16")
    accelerator.scaler = scaler
    for opt in getattr(accelerator, "_optimizers", []):
        if getattr(opt, "scaler", None) is held:
            opt.scaler = scaler


__all__ = ["register"]

"""Hugging Face transformers' ``Trainer``: ``hetcomm.integrations.transformers.register(trainer, state)``.

::

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    state = hetcomm.integrations.transformers.register(trainer, hetcomm.HookState("auto"))
    trainer.train()                              # or trainer.train(resume_from_checkpoint=True / PATH)

``Trainer`` wraps the model in DDP inside ``train()`` (through Accelerate),
so the hook goes on at the first callback of the run, ``on_train_begin``:
after the wrapping, the optimizer's creation and a checkpoint's loading, before
the first step. Each checkpoint folder the Trainer writes (``checkpoint-N``
under ``output_dir``, after step N) gets each rank's hook state beside its own
files, ``hetcomm-rank<r>.pt`` from every process (a HookState is each rank's
own: error feedback), and ``train(resume_from_checkpoint=...)`` loads it from
the folder the Trainer resumes from (``strict=False``, as Lightning's strategy
and the Accelerate integration load: on another number of processes the step
count and warm-up carry on). A resumed checkpoint without them (saved without
hetcomm) starts the hook's state afresh, with a warning. Under fp16 the
Trainer's GradScaler (Accelerate's) becomes a :class:`hetcomm.amp.GradScaler`.

The Trainer's gradient clipping (``max_grad_norm``, 1.0 by default) clips by
the norm of the gradient the ranks reduced (:meth:`hetcomm.HookState.clip_grad_norm_`,
in place of its accelerator's ``clip_grad_norm_``), not by the norm of what a
lossy codec handed back: that is the gradient plus the error feedback being
repaid, and clipping it clips more and harder than fp32 would (hetcomm warns
where it sees that). Gradient accumulation (``no_sync``) needs nothing more.
``register(..., attach_optimizer=True)`` compresses the optimizer's momentum
instead of the gradient (:meth:`hetcomm.HookState.attach_optimizer` on the
optimizer the Trainer makes inside ``train()``, with the run's ``max_steps`` as
``total_steps``: its first fifth the warm-up): SGD with momentum
(``optim="sgd", optim_args="momentum=0.9"``) or the Trainer's AdamW.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..checkpoint import read_rank_file
from ..hooks import hook
from ..state import HookState
from .accelerate import _clip_through_hetcomm, _rank_file, _scale_through_hetcomm

log = logging.getLogger("hetcomm")


class HetcommCallback(TrainerCallback):
    """The callback :func:`register` adds (module docstring)."""

    def __init__(self, trainer: Any, state: HookState, attach_optimizer: bool = False) -> None:
        self.trainer, self.state, self.attach = trainer, state, attach_optimizer
        self.resume: Optional[str] = None  # the checkpoint folder this train() call resumes from
        self._hooked: Optional[DistributedDataParallel] = None
        self._attached: Any = None  # the optimizer attached (a later train() call keeps the Trainer's)

    def on_train_begin(self, args, state, control, **kwargs):
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            raise ValueError(f"hetcomm.integrations.transformers: the Trainer's model is a {type(ddp).__name__}, not "
                             "a DistributedDataParallel: hetcomm reduces across processes (launch with torchrun on "
                             "several; on one there is nothing to reduce)")
        if ddp is not self._hooked:  # a DDP model takes one hook; a later train() call may wrap anew
            ddp.register_comm_hook(self.state, hook)
            self._hooked = ddp
        if self.attach and self.trainer.optimizer is not self._attached:
            self.state.attach_optimizer(self.trainer.optimizer, total_steps=state.max_steps)
            self._attached = self.trainer.optimizer
        _scale_through_hetcomm(self.trainer.accelerator, self.state)
        _clip_through_hetcomm(self.trainer.accelerator, self.state)
        if self.resume is not None:
            saved = read_rank_file(lambda r: _rank_file(self.resume, r), args.process_index)
            if saved is None:
                log.warning("hetcomm: %s holds no hetcomm-rank*.pt (saved without "
                            "hetcomm.integrations.transformers.register): the hook's state starts afresh",
                            self.resume)
            else:
                self.state.load_state_dict(saved, strict=False)
        return control

    def on_save(self, args, state, control, **kwargs):
        # every process, into the folder the Trainer wrote after this step (its rank files are there too)
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state.state_dict(), _rank_file(folder, args.process_index))
        return control


def register(trainer: Any, state: HookState, attach_optimizer: bool = False) -> HookState:
    """Have ``trainer`` (a ``transformers.Trainer``) reduce through ``state``
    with :func:`hetcomm.hook` and carry it in its checkpoints (module
    docstring); ``attach_optimizer``: its momentum compressed. Call it before
    ``trainer.train()``. Returns ``state``."""
    if not isinstance(state, HookState):
        raise ValueError(f"state must be a hetcomm.HookState, got {type(state).__name__}")
    if not hasattr(trainer, "callback_handler") or not hasattr(trainer, "train"):
        raise ValueError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    if any(isinstance(cb, HetcommCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("hetcomm.integrations.transformers.register: this Trainer already has a HookState")
    callback = HetcommCallback(trainer, state, attach_optimizer)
    trainer.add_callback(callback)
    train = trainer.train

    def train_resuming(*args, **kwargs):
        """``trainer.train``, noting the folder a resume loads (``True``: the
        last checkpoint under ``output_dir``, as the Trainer finds it)."""
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if isinstance(resume, bool):
            resume = get_last_checkpoint(trainer.args.output_dir) if resume else None
        callback.resume = resume
        return train(*args, **kwargs)

    trainer.train = train_resuming
    return state


__all__ = ["register", "HetcommCallback"]

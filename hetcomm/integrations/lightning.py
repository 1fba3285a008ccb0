"""PyTorch Lightning: ``Trainer(strategy=hetcomm.integrations.lightning.HetcommDDPStrategy())``.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers comm hooks only on
CUDA and needs the hook's state before the process group exists. This
strategy builds the :class:`hetcomm.HookState` once the group is up (on every
rank, with the same arguments), registers :func:`hetcomm.hook` on any device,
optionally attaches the optimizer (momentum compression), and saves / restores
each rank's hetcomm state next to Lightning's checkpoint
(``<checkpoint>.hetcomm-rank<r>.pt``: residuals are per rank, Lightning's file
is written by rank 0 alone). Under ``precision="16-mixed"`` or ``"bf16-mixed"``
the precision plugin's scaler is a :class:`hetcomm.amp.GradScaler` (the hook
reduces unscaled gradients; ranks may differ in precision).
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any, Dict, Mapping, Optional, Union

import torch

from .. import amp
from ..checkpoint import read_rank_file
from ..hooks import hook
from ..state import HookState

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.strategies import DDPStrategy
    except ImportError as e:  # pragma: no cover - only without Lightning
        raise ImportError("hetcomm.integrations.lightning needs PyTorch Lightning: pip install pytorch-lightning") \
            from e


#: HookState.attach_optimizer's keyword arguments (what attach_optimizer={...} may hold)
_ATTACH_KEYWORDS = tuple(n for n, p in inspect.signature(HookState.attach_optimizer).parameters.items()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY)


#: Lightning's MixedPrecision plugin precisions -> hetcomm.amp's
_PLUGIN_PRECISIONS = {"16-mixed": "fp16", "bf16-mixed": "bf16"}


def _rank_file(filepath: str, rank: int) -> str:
    return f"{filepath}.hetcomm-rank{rank}.pt"


class HetcommDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with hetcomm's hook on every bucket.

    Args:
        compression: :class:`hetcomm.HookState`'s ``compression``; by
            default "auto", which chooses among the modes measured to reach
            fp32's quality with the fit's optimizer (onebit compresses the
            gradient unless the optimizer is attached, and a momentum of
            the gradient misses fp32's quality: "onebit" wants
            ``attach_optimizer=True``).
        attach_optimizer: compress the optimizer's momentum
            (:meth:`HookState.attach_optimizer`; SGD with momentum, Adam or
            AdamW; several, as a GAN's manual optimization configures, are
            attached together: one kind, one beta), with the fit's length
            as ``total_steps``
            (``trainer.estimated_stepping_batches``, when finite): the first
            fifth of the fit is the warm-up (its gradient in fp8, the
            default). True, or a dict of ``attach_optimizer``'s keyword
            arguments (``{"warmup_compression": "none"}`` for an exact
            warm-up, ``{"exact_every": 0}``; a
            ``total_steps`` given there is used instead of Lightning's).
        follow_lr: without ``attach_optimizer``, whether error feedback
            follows the learning rate of the fit's optimizer(s)
            (:meth:`HookState.follow_lr`). None (default): when each is a
            ``torch.optim.SGD`` (the update is
            linear in the gradient there, and the measured runs gained; with
            Adam they did not, README). An attached optimizer's rate is
            followed anyway.
        hook_options: the other :class:`HookState` arguments (``start_iter``,
            ``algorithm``, ``topk_ratio``, ...).
        precision_per_device: with ``Trainer(precision="16-mixed")`` or
            ``"bf16-mixed"``, each rank computes in its own device's
            precision instead (:func:`hetcomm.amp.precision_for`: bf16 where
            native, as on an A100 or H100; fp16 with loss scaling on a V100
            or T4; ``HETCOMM_PRECISION`` overrides it on a rank), under
            :class:`hetcomm.amp.GradScaler`: a mixed cluster's every
            generation at its fastest. A rank whose device has neither (it
            would compute in fp32) is a ``ValueError`` naming it.
        **kwargs: ``DDPStrategy``'s own (``process_group_backend``,
            ``find_unused_parameters``, ...).
    """

    strategy_name = "hetcomm_ddp"

    def __init__(self, compression: str = "auto", *, attach_optimizer: Union[bool, Mapping[str, Any]] = False,
                 follow_lr: Optional[bool] = None, hook_options: Optional[Dict[str, Any]] = None,
                 precision_per_device: bool = False, **kwargs: Any) -> None:
        if "ddp_comm_hook" in kwargs or "ddp_comm_state" in kwargs or "ddp_comm_wrapper" in kwargs:
            raise ValueError("HetcommDDPStrategy registers hetcomm's hook itself: do not pass ddp_comm_hook, "
                             "ddp_comm_state or ddp_comm_wrapper")
        if not isinstance(attach_optimizer, (bool, Mapping)):
            raise ValueError(f"attach_optimizer must be True, False or a dict of HookState.attach_optimizer's "
                             f"keyword arguments, got {attach_optimizer!r}")
        if follow_lr is not None and not isinstance(follow_lr, bool):
            raise ValueError(f"follow_lr must be True, False or None (follow an SGD), got {follow_lr!r}")
        if not isinstance(precision_per_device, bool):
            raise ValueError(f"precision_per_device must be True or False, got {precision_per_device!r}")
        unknown = set(attach_optimizer) - set(_ATTACH_KEYWORDS) if isinstance(attach_optimizer, Mapping) else set()
        if unknown:
            raise ValueError(f"attach_optimizer: unknown keyword(s) {sorted(unknown)}; HookState.attach_optimizer "
                             f"takes {', '.join(_ATTACH_KEYWORDS)}")
        super().__init__(**kwargs)
        self._compression = compression
        self._attach = bool(attach_optimizer) or isinstance(attach_optimizer, Mapping)
        self._attach_options = dict(attach_optimizer) if isinstance(attach_optimizer, Mapping) else {}
        self._follow_lr = follow_lr
        self._per_device = precision_per_device
        self._hook_options = dict(hook_options or {})
        self._pending: Optional[Dict[str, Any]] = None
        #: The HookState, once fit has set up DDP (None before).
        self.hook_state: Optional[HookState] = None

    def _register_ddp_hooks(self) -> None:
        # Called by configure_ddp once the model is wrapped: the group exists.
        self.hook_state = HookState(self._compression, **self._hook_options)
        self.model.register_comm_hook(self.hook_state, hook)
        if self._pending is not None:
            self._load_hook_state(self._pending)
            self._pending = None

    def setup(self, trainer) -> None:
        super().setup(trainer)
        # validate / test / predict wrap no DDP and run no hook; hook_state is still the last fit's (closed)
        fitting = trainer.state.fn == "fit"
        self._scale_through_hetcomm(fitting)
        self._clip_through_hetcomm()
        if not fitting:
            self._pending = None  # validate(ckpt_path=...)'s hetcomm state is no later fit's
            return
        if self.hook_state is None:
            return
        opts = list(self.optimizers)  # several (a GAN's two): attached or followed together
        if self._attach:
            if not opts:
                raise ValueError("HetcommDDPStrategy(attach_optimizer=True) needs an optimizer, got none")
            # the fit's optimizer steps (inf: no limit set); with several, each steps once a batch in turn, and
            # the hook counts each bucket's own steps (hetcomm.own_steps): about one a batch too
            steps = trainer.estimated_stepping_batches
            total = int(steps) if isinstance(steps, (int, float)) and math.isfinite(steps) and steps >= 1 else None
            self.hook_state.attach_optimizer(opts, **{"total_steps": total, **self._attach_options})
        elif self._follow_lr is not False:
            if self._follow_lr and not opts:
                raise ValueError("HetcommDDPStrategy(follow_lr=True) needs an optimizer, got none")
            if opts and (self._follow_lr or all(isinstance(o, torch.optim.SGD) for o in opts)):
                self.hook_state.follow_lr(opts)

    def _scale_through_hetcomm(self, fitting: bool) -> None:
        """``precision="16-mixed"`` / ``"bf16-mixed"`` (Lightning's
        ``MixedPrecision``): its scaler becomes a :class:`hetcomm.amp.GradScaler`
        of this rank's precision, with torch's settings. torch's would hand the
        hook gradients times the loss scale, and error feedback and a
        compressed momentum kept across a backoff (or a growth) would then mix
        two scales; a bf16 rank gets one too (scale 1), so ranks in fp16 and
        bf16 skip the same overflow steps and agree on each other's precision
        (but not next to an LBFGS, which Lightning refuses beside a scaler: a
        bf16 fit with it runs as Lightning runs it). In ``setup``, once the
        optimizers exist and before the checkpoint's scaler state is restored
        (Lightning restores it after ``setup``); a later fit's new HookState
        takes over the scaler with its scale. ``precision_per_device``: the
        plugin's precision is first set to this rank's device's (in
        ``validate``, ``test`` and ``predict`` too)."""
        plugin = self.precision_plugin
        kind = _PLUGIN_PRECISIONS.get(getattr(plugin, "precision", None))
        if self._per_device:
            kind = self._device_precision(plugin, kind)
        held = getattr(plugin, "scaler", None)
        if not fitting or self.hook_state is None or kind is None or not hasattr(plugin, "scaler"):
            return
        device = getattr(plugin, "device", "cuda")
        if isinstance(held, amp.GradScaler):  # a later fit: its scale and growth carry on, for the new state
            if held._state() is not self.hook_state:
                plugin.scaler = amp.GradScaler.taking_over(self.hook_state, held, device, held.precision)
            return
        if held is None or kind == "bf16":  # bf16: no scaler in Lightning; hetcomm's keeps the scale at 1
            if any(isinstance(o, torch.optim.LBFGS) for o in self.optimizers):
                return  # every rank holds the same optimizers, so every rank goes without: they agree
            plugin.scaler = amp.GradScaler(self.hook_state, torch.device(device).type, precision=kind)
            return
        if not held.is_enabled():
            return  # a scaler the user disabled: the gradients reach the hook unscaled
        plugin.scaler = amp.GradScaler.taking_over(self.hook_state, held, device, kind)

    def _device_precision(self, plugin, kind: Optional[str]) -> str:
        """``precision_per_device``: this rank's device's precision, set on
        Lightning's ``MixedPrecision`` plugin (whose autocast reads it)."""
        if kind is None:
            raise ValueError(f"HetcommDDPStrategy(precision_per_device=True) needs Trainer(precision='16-mixed' or "
                             f"'bf16-mixed'), got precision {getattr(plugin, 'precision', None)!r}")
        mine = amp.precision_for(self.root_device)
        if mine == "fp32":
            raise ValueError(f"HetcommDDPStrategy(precision_per_device=True): rank {self.global_rank}'s device "
                             f"{self.root_device} computes neither bf16 natively nor fp16 fast (it would run fp32); "
                             f"set {amp.ENV_PRECISION}=fp16 or bf16 there, or leave precision_per_device off")
        plugin.precision = next(name for name, p in _PLUGIN_PRECISIONS.items() if p == mine)
        return mine

    def _clip_through_hetcomm(self) -> None:
        """``Trainer(gradient_clip_val=C)`` (by norm) clips by the reduced
        gradient's norm (:meth:`HookState.clip_grad_norm_`), not by the norm
        of what a lossy codec handed back: Lightning's precision plugin calls
        ``torch.nn.utils.clip_grad_norm_``, so its ``clip_grad_by_norm`` is
        replaced on this strategy's plugin."""
        plugin = self.precision_plugin
        if getattr(plugin, "_hetcomm_clip", False):
            return
        by_handed = plugin.clip_grad_by_norm

        def clip_grad_by_norm(optimizer, clip_val) -> None:
            if self.hook_state is None:
                return by_handed(optimizer, clip_val)
            self.hook_state.clip_grad_norm_(list(plugin.main_params(optimizer)), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm
        plugin._hetcomm_clip = True

    def teardown(self) -> None:
        # End of fit: stop the comm thread and let go of the state's group (its
        # stats and state_dict still work; a later fit makes a new state).
        if self.hook_state is not None:
            self.hook_state.close()
        super().teardown()

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.hook_state is not None:  # every rank its own state
            torch.save(self.hook_state.state_dict(), _rank_file(str(filepath), self.global_rank))
        self.barrier("hetcomm_save_checkpoint")

    def load_checkpoint(self, checkpoint_path, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        state = read_rank_file(lambda r: _rank_file(str(checkpoint_path), r), self.global_rank)
        if state is not None:
            if self.hook_state is not None and not self.hook_state._closed:  # the running fit's
                self._load_hook_state(state)
            else:  # Lightning restores before setup: the fit's new HookState takes it (a last fit's is closed)
                self._pending = state
        return checkpoint

    def _load_hook_state(self, state: Dict[str, Any]) -> None:
        # strict=False: resumed on as many devices, the rank's own state to the bit; on another number (Lightning
        # resumes a DDP fit so), the step count and warm-up carry on and each rank's error feedback starts afresh
        self.hook_state.load_state_dict(state, strict=False)

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        path = _rank_file(str(filepath), self.global_rank)
        if os.path.exists(path):
            os.remove(path)


__all__ = ["HetcommDDPStrategy"]

"""Each rank in its own compute precision, in one DDP job.

A mixed cluster trains fastest when each GPU generation computes in its own
precision: bf16 on an A100/H100, fp16 with loss scaling on a V100 (no bf16).
Under plain DDP that is silently wrong: the fp16 ranks' gradients arrive
multiplied by their loss scale and are averaged with the others' unscaled
ones, and an overflow makes one rank skip its step while the others take it.

:class:`GradScaler` is a drop-in for ``torch.amp.GradScaler`` that tells
hetcomm's hook this rank's scale ``s``: the hook reduces ``g / s`` (the scale
joins the batch-size divisor, no extra pass), so every rank receives the same
unscaled gradient, bit for bit. Its ``unscale_`` then only checks those
gradients for inf/NaN: as they are identical on every rank, every rank skips
the same steps and backs off together, with no extra communication. A rank
that needs no loss scaling (bf16, fp32) keeps its scale at 1 and still skips
with the others::

    state = hetcomm.HookState("onebit")
    ddp.register_comm_hook(state, hetcomm.hook)
    scaler = hetcomm.amp.GradScaler(state)   # precision from this rank's device
    for x, y in loader:
        opt.zero_grad()
        with scaler.autocast():
            loss = loss_fn(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
"""

from __future__ import annotations

import logging
import os
import weakref
from collections import defaultdict
from typing import Any, Dict, Optional, Union

import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator, _refresh_per_optimizer_state

log = logging.getLogger("hetcomm")

#: The compute precisions a rank can run in.
PRECISIONS = ("bf16", "fp16", "fp32")
#: The environment variable that overrides the choice of :func:`precision_for` on this rank.
ENV_PRECISION = "HETCOMM_PRECISION"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); emulated bf16 is slower than fp32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def precision_for(device: Union[str, torch.device, None] = None) -> str:
    """The compute precision a rank on ``device`` trains fastest in without
    losing accuracy: ``"bf16"`` where the device computes it natively (CUDA
    compute capability >= 8.0: A100, H100; CPUs with AVX512-BF16 or AMX),
    else ``"fp16"`` with loss scaling on GPUs with fast fp16 (compute
    capability >= 7.0: V100, T4), else ``"fp32"``. The environment variable
    ``HETCOMM_PRECISION`` (bf16, fp16 or fp32) overrides it on this rank.
    ``device`` defaults to the current CUDA device if there is one, else the CPU."""
    forced = os.environ.get(ENV_PRECISION)
    if forced:
        if forced not in PRECISIONS:
            raise ValueError(f"{ENV_PRECISION} must be one of {PRECISIONS}, got {forced!r}")
        return forced
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return "bf16" if major >= 8 else ("fp16" if major >= 7 else "fp32")
    if device.type == "cpu":
        return "bf16" if _cpu_has_bf16() else "fp32"
    return "fp32"


class GradScaler(torch.amp.GradScaler):
    r"""``torch.amp.GradScaler`` for a rank of a DDP job reduced by
    :func:`hetcomm.hook`, in this rank's own precision.

    Create one on every rank, before the first step, with the rank's
    :class:`hetcomm.HookState`; use it exactly as torch's (``scale``,
    ``unscale_``, ``step``, ``update``, ``state_dict``). Differences, all
    deliberate:

    - The gradients of the DDP model come out of ``backward`` already
      unscaled (the hook divided by this rank's scale before reducing) and
      identical on every rank; ``unscale_`` checks them for inf/NaN and
      unscales only gradients the hook did not reduce (parameters outside
      the DDP model).
    - Skipping is collective: a non-finite gradient on any rank reaches every
      rank, so every rank skips the step and every fp16 rank backs off.
    - ``precision`` ``"bf16"`` or ``"fp32"`` (no loss scaling needed): the
      scale stays 1 (no growth, no backoff), the skipping still applies.
      ``enabled=False`` means ``"fp32"``.

    Args:
        state: this rank's :class:`hetcomm.HookState` (registered with DDP).
        device: ``"cuda"`` or ``"cpu"`` (default: CUDA where available).
        precision: ``"bf16"``, ``"fp16"`` or ``"fp32"``; default
            :func:`precision_for` (this rank's device, ``HETCOMM_PRECISION``).
        init_scale, growth_factor, backoff_factor, growth_interval: as
            torch's, for ``"fp16"``.
    """

    def __init__(self, state: Any, device: Optional[str] = None, *, precision: Optional[str] = None,
                 init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        from .state import HookState

        if not isinstance(state, HookState):
            raise ValueError(f"state must be the rank's hetcomm.HookState, got {type(state).__name__}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if precision is None:
            precision = precision_for(device) if enabled else "fp32"
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if not enabled and precision != "fp32":
            raise ValueError(f"enabled=False is fp32 on this rank; got precision {precision!r}")
        if not (isinstance(init_scale, (int, float)) and 0 < init_scale < float("inf")):
            raise ValueError(f"init_scale must be finite and > 0, got {init_scale!r}")
        #: This rank's compute precision (what :meth:`autocast` runs in).
        self.precision = precision
        self._fixed = precision != "fp16"
        # Always enabled inside: a bf16 / fp32 rank still takes part in the collective skip decision.
        super().__init__(device, init_scale=1.0 if self._fixed else float(init_scale), growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=True)
        self._host_scale = self._init_scale  # what the hook divides by: the scale as of the last update()
        self._state = weakref.ref(state)
        state._attach_scaler(self)
        self._reduced_at = state._steps_done  # at the last update(): a larger count means DDP reduced since

    @classmethod
    def taking_over(cls, state: Any, held: torch.amp.GradScaler, device: Any, precision: str) -> "GradScaler":
        """A scaler of ``state`` going on from ``held`` (torch's, as a
        framework's precision plugin makes it, or a hetcomm one of an earlier
        state): its scale, growth settings and growth tracker, through its
        ``state_dict``. ``device``: a ``torch.device`` or its name (its
        type counts)."""
        scaler = cls(state, torch.device(device).type, precision=precision)
        scaler.load_state_dict(held.state_dict())
        return scaler

    # ---- what the hook reads -------------------------------------------------
    def loss_scale(self) -> float:
        """This rank's scale of the coming backward (1 for bf16 / fp32), on the
        host: kept by :meth:`update`, so the hook never waits for the GPU."""
        return self._host_scale

    # ---- torch.amp.GradScaler, adapted ----------------------------------------
    def autocast(self) -> torch.autocast:
        """``torch.autocast`` in this rank's precision (disabled for fp32)."""
        return torch.autocast(self._device, dtype=DTYPES[self.precision], enabled=self.precision != "fp32")

    def scale(self, outputs):
        state = self._state()
        if state is None or state._closed:
            raise RuntimeError("hetcomm.amp.GradScaler: its HookState is closed (a finished run's); the new "
                               "HookState takes a new GradScaler(new_state, ...): load_state_dict(this one's "
                               "state_dict()) carries the scale over")
        return super().scale(outputs)

    def _ready(self) -> None:
        if self._scale is None:  # scale() never called (a bf16 rank calling loss.backward() itself)
            self._lazy_init_scale_growth_tracker(torch.device(self._device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._ready()
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Optional[float]:
        self._ready()
        # Optimizers that unscale inside their fused step would divide the
        # already unscaled gradients again: unscale (check) them here first.
        if self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        self._ready()
        if self._fixed:
            if new_scale is not None:
                raise ValueError(f"this rank runs in {self.precision}: its loss scale stays 1 (new_scale given)")
            if not any(s["found_inf_per_device"] for s in self._per_optimizer_states.values()):
                raise AssertionError("No inf checks were recorded prior to update.")
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        else:
            super().update(new_scale)
            self._host_scale = self.get_scale()  # one sync per step, after the optimizer's
        state = self._state()
        self._reduced_at = state._steps_done if state is not None else 0

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
        """torch's, except that gradients the hook reduced this iteration are
        already unscaled: they are only checked (inverse scale 1)."""
        state = self._state()
        reduced = state is not None and state._steps_done > self._reduced_at
        holds = state._reduced_param if reduced else (lambda p: False)
        one = torch.ones_like(inv_scale)
        per_device_inv = {True: _MultiDeviceReplicator(one), False: _MultiDeviceReplicator(inv_scale)}
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        groups: Dict[Any, list] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grad = param.grad
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    groups[(grad.device, grad.dtype, holds(param))].append(grad)
            for (device, _, done), grads in groups.items():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, per_device_found_inf.get(device),
                                                                 per_device_inv[done].get(device))
        return per_device_found_inf._per_device_tensors

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "precision": self.precision}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        state_dict = {k: v for k, v in state_dict.items() if k != "precision"}
        super().load_state_dict(state_dict)
        if self._fixed:  # a checkpoint of an fp16 rank resumed on a bf16 one: no scaling here
            self._init_scale = 1.0
            if self._scale is not None:
                self._scale.fill_(1.0)
        self._host_scale = float(self._init_scale if self._scale is None else self.get_scale())

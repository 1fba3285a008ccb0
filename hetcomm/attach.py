"""The optimizer a HookState follows (or several together:
:mod:`hetcomm.optimizer_set`): :meth:`attach_optimizer` (its momentum
compressed) and :meth:`follow_lr` (error feedback in its learning rate's
units), a mixin of :class:`hetcomm.state.HookState`; and what each step reads
of it: a rate or momentum a schedule moved, the momentum and Adam's
denominator laid out as a bucket."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple, Union

import torch

from . import buckets, options
from .bucket_keys import offset_in
from .optimizer_set import Joined, Optimizers, optimizer_list

if TYPE_CHECKING:
    from .state import HookState

log = logging.getLogger("hetcomm")

#: With an Adam attached, every this many compressed steps one is exact (attach_optimizer's default).
EXACT_EVERY = 16
#: attach_optimizer(total_steps=N): the first this fraction of the run is the warm-up, the gradient reduced
#: without momentum compression (attach_optimizer's ``warmup_fraction`` default; README).
WARMUP_FRACTION = 0.2


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill their memory without gaps or overlaps in
    some order of its dimensions (contiguous, channels_last, any permutation):
    c10's is_non_overlapping_and_dense, which DDP's reducer asks of each parameter."""
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def _as_bucket(bucket: buckets.Bucket, buf: torch.Tensor, parts, params, fill: float) -> torch.Tensor:
    """Per-parameter tensors (optimizer state, one per gradient of the
    bucket, None where there is none) laid out as their gradients are in the
    bucket's buffer: float32, ``fill`` elsewhere. DDP keeps a gradient in the
    bucket in its parameter's memory order where that parameter is dense (a
    channels_last convolution's weight: NHWC), while the bucket's gradient
    views claim contiguous strides (torch 2.13); so each tensor is copied
    through its parameter's strides, as DDP's reducer lays the bucket out."""
    out = torch.full((buf.numel(),), fill, dtype=torch.float32, device=buf.device)
    for g, part, p in zip(bucket.grads, parts, params):
        if part is not None and g.numel():  # (an empty tensor's data_ptr is no offset into the bucket)
            slot = out.narrow(0, offset_in(g, buf), g.numel())
            if p is not None and _dense(p):
                slot = slot.as_strided(p.shape, p.stride())
            else:
                slot, part = slot.view(g.shape), part.reshape(g.shape)
            slot.copy_(part.detach())
    return out


def optimizer_beta(optimizer: torch.optim.Optimizer, adam: bool, who: str) -> Tuple[float, str]:
    """The momentum ``optimizer`` runs with, Adam's ``betas[0]`` or SGD's
    ``momentum``, and its name; a ValueError starting with ``who`` when its
    parameter groups differ (momentum compression keeps one for all)."""
    what = "betas[0]" if adam else "momentum"
    betas = {float(g["betas"][0]) if adam else float(g.get("momentum", 0.0)) for g in optimizer.param_groups}
    if len(betas) != 1:
        raise ValueError(f"{who}: every parameter group must have the same {what}, got {sorted(betas)}")
    return betas.pop(), what


def _kind(optimizer) -> str:
    """``optimizer``'s kind as attach_optimizer keeps it (options.ATTACHED):
    "sgd", "adam" (torch's Adam / AdamW) or "hetcomm-adamw"; a ValueError
    naming the rule where it cannot be attached."""
    from . import optim

    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        raise ValueError("optimizer: a ZeroRedundancyOptimizer keeps each parameter's momentum on one rank "
                         "only, and attach_optimizer needs it on every rank (every rank sends beta * m + g); "
                         "with ZeRO compress the gradient (register the hook without attach_optimizer) or "
                         "attach an unsharded torch.optim.SGD / Adam / AdamW")
    if isinstance(optimizer, torch.optim.SGD):
        if any(float(g.get("dampening", 0.0)) != 0.0 for g in optimizer.param_groups):
            raise ValueError("optimizer: dampening must be 0 for momentum compression")
        return "sgd"
    if isinstance(optimizer, optim.AdamW):
        return "hetcomm-adamw"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    raise ValueError(f"optimizer must be a torch.optim.SGD with momentum, hetcomm.optim.AdamW, "
                     f"torch.optim.Adam or torch.optim.AdamW, got {type(optimizer).__name__}")


class OptimizerLink:
    """HookState's link to the user's optimizer (the attributes are HookState's)."""

    def attach_optimizer(self, optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]], *,
                         exact_every: Optional[int] = None, total_steps: Optional[int] = None,
                         warmup_compression: Optional[str] = None,
                         warmup_fraction: Optional[float] = None) -> "HookState":
        """Compress the optimizer's momentum instead of the gradient (call on
        every rank before the first step; returns the state).

        ``torch.optim.SGD(momentum=beta)``: each rank sends its local momentum
        ``beta * m + g`` through the codec (error feedback included), every
        rank gets the same new momentum ``m``, and the hook hands the optimizer
        ``m_new - beta * m_old``: the optimizer's own momentum buffer then *is*
        the compressed momentum (plus the momentum of its weight decay, which
        stays exact). Compressing the gradient under momentum lets the codec's
        error be amplified by 1 / (1 - beta). Before ``start_iter`` (and for
        buckets below ``min_compress_numel``) ``m`` follows the optimizer's
        buffer bit for bit.

        :class:`hetcomm.optim.AdamW` (recommended), ``torch.optim.Adam`` /
        ``AdamW``: the same for Adam's first moment (``betas[0]``), and the
        steps ``start_iter + 2**j - 1`` (j = 0, 1, 2, ...) and every
        ``exact_every``-th step after ``start_iter`` (default 16 with an
        Adam; 0: the doublings only) are reduced exactly in fp32. hetcomm's
        AdamW updates its variance on those steps only (a variance from the
        doublings alone rests on a few dozen samples: 1 point of accuracy on
        digits, measured in the README); torch's sees every step's compressed
        difference (noisier, smaller steps). These steps are counted in each
        bucket's own steps, as ``start_iter`` is (a parameter switched off
        does not count: :mod:`hetcomm.own_steps`). ``exact_every`` must be 0
        or None with SGD. With an Adam, top-k sends the momentum's entries with the
        largest update, ``|m| / (sqrt(v) + eps)`` as the optimizer's next
        step divides, not the largest ``|m|``.

        ``total_steps`` (the whole run's optimizer steps, as an LR schedule
        takes them): the first
        ``WARMUP_FRACTION`` (a fifth) of them are the warm-up, the gradient
        reduced without momentum compression (``warmup_compression``),
        ``start_iter`` rises to that if it is lower (1-bit Adam's warm-up: the
        compressed momentum's error costs most while the model moves fast;
        measured in the README), and ``compression="auto"`` may then choose
        onebit. None: ``start_iter`` as given. A run resumed from a
        :meth:`state_dict` saved after its warm-up keeps the saved
        ``start_iter`` (and an Adam's exact steps with it), whatever
        ``total_steps`` or ``warmup_fraction`` it is given now: a longer run
        does not go back into a warm-up; one resumed inside the warm-up ends
        it where the new arguments say.

        ``warmup_fraction`` (with ``total_steps``; None: ``WARMUP_FRACTION``,
        0.2): the warm-up's share of the run, a number in (0, 1). Where the
        link is slow the warm-up's steps cost most of a run's time (fp8 sends
        about 5x onebit's bytes, 25x top-k's). Measured (bench/README "How
        long a warm-up"): onebit of the momentum kept fp32's quality on the
        language model and the regression with a twentieth (0.05), at fp32's
        steps to target; on digits a tenth or a twentieth ended 0.2-0.4
        points under fp32's mean (a fifth: under 0.15; tolerance 0.5), and
        top-k needs the whole fifth. The same on every rank.

        ``warmup_compression``: how the warm-up's steps from step 2 up to
        ``start_iter`` reduce the gradient: ``"none"`` (exact fp32) or
        ``"fp8"`` (the gradient, not the momentum, in 8 bits with error
        feedback: a quarter of the bytes; the optimizer's momentum and an
        attached hetcomm AdamW's variance take it as exact). The momentum
        compression starts from the optimizer's buffer at ``start_iter``.
        None (the default): ``"fp8"`` when ``total_steps`` is given (the
        warm-up is then hetcomm's: as close to fp32 as the exact one,
        measured, at 40-60 % fewer bytes over the run), except under
        ``compression="auto"`` with ``candidates`` that leave fp8 out;
        otherwise ``"none"`` (a ``start_iter`` of your own stays exact).

        Learning-rate schedules: error feedback's residuals follow the
        optimizer's rate, as :meth:`follow_lr` has them do without attaching
        (when a scheduler moves it from ``a`` to ``b``, what they hold back is
        multiplied by ``a / b``), so what was held back moves the parameters
        as far when sent as it would have when held (README "Limits":
        onebit+m under a cosine schedule); parameter groups
        moved by different factors: each bucket by its groups' factor, a
        bucket holding groups that moved differently is left as it is (logged
        once). A scheduled momentum (``OneCycleLR``'s ``cycle_momentum``, its
        default: SGD's ``momentum`` or Adam's ``betas[0]`` every step) is
        followed too: each step's momentum is sent and handed over with the
        optimizer's beta of that step, so its buffer stays the compressed
        momentum (all groups must share one beta at every step).

        Several optimizers on one DDP model (a GAN's generator and
        discriminator, Lightning's manual optimization): pass them together,
        ``attach_optimizer([opt_g, opt_d])``: one kind (SGD, torch's
        Adam/AdamW, or hetcomm's AdamW) and one momentum (SGD's ``momentum``,
        Adam's ``betas[0]``) for all, no parameter in two. Each parameter's
        momentum, and with an Adam the denominator top-k ranks its entries
        by, are read from the optimizer that steps it; their rates are
        followed group by group. A parameter none of them steps is reduced
        the same way (its momentum kept at the attached beta, the difference
        handed over: under an optimizer without momentum, its gradient with
        error feedback), and top-k ranks a bucket holding it by ``|m|``.

        Nothing to retune: keep the optimizer, its learning rate and betas.
        With loss scaling use :class:`hetcomm.amp.GradScaler` (torch's hands
        the hook scaled gradients: the momentum would mix scales).
        """
        if self._negotiated:
            raise RuntimeError("attach_optimizer must be called before the first step, on every rank")
        opts = optimizer_list(optimizer, "attach_optimizer")
        self._check_lr_source(opts, "attach_optimizer")
        kinds = [_kind(o) for o in opts]
        if len(set(kinds)) > 1:
            raise ValueError(f"optimizer: the optimizers attached together must be of one kind (SGD, torch's "
                             f"Adam/AdamW, or hetcomm.optim.AdamW), got {', '.join(type(o).__name__ for o in opts)}")
        adam = kinds[0] != "sgd"
        attached = Optimizers(opts)
        beta, what = optimizer_beta(attached(), adam, "optimizer")
        if not 0.0 < beta < 1.0:
            raise ValueError(f"optimizer {what} must be in (0, 1) to be compressed, got {beta}"
                             + (": without momentum there is none to compress; leave the optimizer unattached and "
                                "compress the gradient (compression=\"int3\", \"fp8\" or \"auto\")"
                                if beta == 0.0 else ""))
        if exact_every is not None and not (options._is_int(exact_every) and exact_every >= 0):
            raise ValueError(f"exact_every must be an int >= 0 or None, got {exact_every!r}")
        if exact_every and not adam:
            raise ValueError(f"exact_every applies to an attached Adam (its variance's exact steps), not to "
                             f"{type(optimizer).__name__}: leave it None")
        if total_steps is not None and not (options._is_int(total_steps) and total_steps >= 1):
            raise ValueError(f"total_steps must be an int >= 1 (the run's optimizer steps) or None, got "
                             f"{total_steps!r}")
        if warmup_fraction is not None:
            if total_steps is None:
                raise ValueError("warmup_fraction is a share of total_steps: pass total_steps too (or set "
                                 "start_iter for a warm-up of your own length)")
            if not options._is_number(warmup_fraction) or not 0.0 < float(warmup_fraction) < 1.0:
                raise ValueError(f"warmup_fraction must be a number in (0, 1) (the warm-up's share of the run) "
                                 f"or None, got {warmup_fraction!r}")
        fraction = WARMUP_FRACTION if warmup_fraction is None else float(warmup_fraction)
        if warmup_compression is None:
            fp8_allowed = self.candidates is None or "fp8" in self.candidates
            warmup_compression = "fp8" if total_steps is not None and fp8_allowed else "none"
        if warmup_compression not in options.WARMUP_WIRES:
            raise ValueError(f"warmup_compression must be one of {', '.join(options.WARMUP_WIRES)}, got "
                             f"{warmup_compression!r}")
        if total_steps is not None:
            # rounded to 1e-9 first: 0.29 * 100 is 28.999999999999996 in floats, and the warm-up is 29 steps
            self.start_iter = max(self.start_iter, int(round(fraction * total_steps, 9)))
        if self._resumed_start is not None:  # loaded first: a run past its warm-up keeps its schedule
            self.start_iter = self._resumed_start
        self._warmup_compression = warmup_compression
        self._total_steps = total_steps
        self._warmup_fraction = fraction if total_steps is not None else None
        self._beta = beta if self._saved_beta is None else self._saved_beta
        self._optimizer = self._lr_source = attached
        self._exact_every = (EXACT_EVERY if exact_every is None else exact_every) if adam else 0
        self._attached = kinds[0]
        if self._attached == "hetcomm-adamw":
            ref = weakref.ref(self)
            for o in opts:
                o._exact = lambda: (lambda s: s is None or s._last_step_exact())(ref())
        return self

    def follow_lr(self, optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]) -> "HookState":
        """Keep error feedback in the units of ``optimizer``'s learning rate
        when the gradient itself is compressed (no :meth:`attach_optimizer`,
        which does this for the optimizer(s) it attaches). Call on every rank
        before the first step; returns the state. Several optimizers on one
        DDP model: pass them in one list. Only each group's ``lr`` is
        read, at the start of every step, so any optimizer with
        ``param_groups`` is accepted; it is meant for SGD (below).

        Why: the residuals hold back gradient that the optimizer multiplies by
        a *later* step's rate. When a scheduler moves a group's rate from
        ``a`` to ``b``, what a bucket's residuals hold is multiplied by
        ``a / b``, so once sent it moves the parameters as far as it would
        have when it was held back (EF-SGD's residual is in update units); a
        decaying rate otherwise shrinks what was held back, a warm-up inflates
        it. The rules are ``attach_optimizer``'s: a group at rate 0 keeps its
        state until its next nonzero rate; groups moved by different factors:
        each bucket by its groups' factor, a bucket holding groups that moved
        differently is left as it is (logged once). ``state_dict()`` keeps the
        rates followed. A run at a constant rate is unchanged to the bit.

        Meant for SGD (plain, momentum, Nesterov), whose update is linear in
        the gradient. An Adam's is not: it divides by the gradient's running
        RMS, so a residual scaled up by a decaying rate mostly inflates the
        variance; measured under cosine and one-cycle schedules, following
        with AdamW was neutral to worse (top-k on the regression +7 % under
        one-cycle), with SGD-momentum neutral to better (README).
        """
        if self._negotiated:
            raise RuntimeError("follow_lr must be called before the first step, on every rank")
        opts = optimizer_list(optimizer, "follow_lr")
        self._check_lr_source(opts, "follow_lr")
        self._lr_source = Optimizers(opts)
        return self

    def _check_lr_source(self, opts: List[torch.optim.Optimizer], who: str) -> None:
        followed = self._lr_source
        if followed is not None and followed() is not None and not followed.same(opts):
            raise ValueError(f"{who}: optimizer is not the one whose learning rate this state already follows "
                             f"({len(followed)} optimizer(s)); one HookState follows one optimizer, or several "
                             f"given together in one list")

    def _follow_momentum(self) -> None:
        """Follows a momentum that a schedule moves (``OneCycleLR``'s
        ``cycle_momentum``, the default: SGD's ``momentum`` or Adam's
        ``betas[0]``, every step). The step's momentum is sent and handed over
        with the optimizer's beta of this step, and for an Adam, whose first
        moment is ``(1 - beta1) m``, the compressed momentum kept is multiplied
        by ``(1 - old) / (1 - new)``: the optimizer's buffer stays the
        compressed momentum (tested after every step of a ``OneCycleLR`` run,
        and across a resume: ``state_dict`` keeps the beta)."""
        opt = self._optimizer()
        if opt is None:
            return
        adam = self._attached != "sgd"
        beta, what = optimizer_beta(opt, adam, "hetcomm: the attached optimizer (at this step)")
        if beta == self._beta:
            return
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"hetcomm: the attached optimizer's {what} moved to {beta}; momentum compression needs "
                             f"it in [0, 1)")
        if adam:
            self._buckets.scale_momentum((1.0 - self._beta) / (1.0 - beta))
        self._beta = beta

    def _follow_lr(self) -> None:
        """Keeps error feedback's state in update units under a learning-rate
        schedule: when the followed optimizer's rate moved from ``a`` to ``b``
        since the last step, what a bucket's residuals hold back is multiplied
        by ``a / b``, so once sent it moves the parameters as far as it would
        have when it was held back (a decaying rate otherwise shrinks it;
        measured under a cosine schedule, README "Limits"). A group at rate 0
        keeps its state as it is until its next nonzero rate. Groups moved by
        different factors: each bucket by its groups' factor; a bucket whose
        parameters' groups moved by different factors stays as it is (said
        once). The optimizer is ``attach_optimizer``'s or ``follow_lr``'s."""
        opt = self._lr_source()
        if opt is None:
            return
        lrs = [float(g["lr"]) for g in opt.param_groups]
        last = self._lrs
        if last is None or len(last) != len(lrs):
            self._lrs = lrs
            return
        # a group at rate 0 moves nothing this step: its state keeps the units of its last nonzero rate
        lrs = [b if b > 0.0 else a for a, b in zip(last, lrs)]
        self._lrs = lrs
        if lrs == last:
            return
        factors = [a / b if a > 0.0 else 1.0 for a, b in zip(last, lrs)]

        def one(fs: List[float]) -> Optional[float]:  # the factor they share (to float rounding), or None
            return fs[0] if fs and max(fs) - min(fs) <= 1e-6 * max(fs) else None

        shared = one(factors)
        if shared is not None:
            self._buckets.scale_error_feedback(lambda params: shared)
            return
        group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        left = self._buckets.scale_error_feedback(
            lambda params: one([factors[group_of[id(p)]] for p in params if p is not None and id(p) in group_of]))
        if left and not self._lr_warned:
            self._lr_warned = True
            log.warning("hetcomm: the followed optimizer's parameter groups changed their learning rates by "
                        "different factors (%s -> %s) and %d bucket(s) hold parameters of groups that moved "
                        "differently: their error-feedback residuals are not rescaled when that happens", last,
                        lrs, left)

    def _optimizer_momentum(self, bucket: buckets.Bucket, buf: torch.Tensor) -> torch.Tensor:
        """The attached optimizer's momentum of the bucket's parameters (each
        one's own, several attached) as the
        hook keeps it (m = beta m + g), laid out as their gradients are in the
        bucket (zero where it has none yet): SGD's momentum buffer; Adam's
        first moment divided by 1 - beta1 (exp_avg = (1 - beta1) m).
        With SGD's weight decay the buffer holds the decay's momentum too: it
        then goes on inside the compressed momentum, and the optimizer's
        trajectory is the one it would follow itself. A group with
        ``maximize=True`` keeps the momentum of the negated gradient: its
        buffer is negated here, into the units of the gradient the hook
        reduces (the hook hands the optimizer the momentum's increment, which
        it negates again)."""
        opt = self._optimizer() if self._optimizer is not None else None
        sgd = self._attached == "sgd"
        name, scale = ("momentum_buffer", 1.0) if sgd else ("exp_avg", 1.0 / (1.0 - self._beta))
        maximized = {id(p) for g in opt.param_groups if g.get("maximize") for p in g["params"]} if opt else set()
        parts, params = [], [self._buckets.params.param(n) for n in bucket.sig]
        for param in params:
            part = opt.state.get(param, {}).get(name) if opt is not None and param is not None else None
            parts.append(-part if part is not None and id(param) in maximized else part)
        m = _as_bucket(bucket, buf, parts, params, 0.0)
        if scale != 1.0:
            m.mul_(scale)
        return m

    def _update_denominator(self, bucket: buckets.Bucket, buf: torch.Tensor, key: str):
        """An attached Adam's per-element denominator (``sqrt(v) + eps``, as
        its step computes it; several attached: each parameter's own Adam's)
        laid out as the bucket: top-k of its momentum
        ranks the entries by the update each would make, ``|m| / denominator``,
        not by ``|m|``: Adam moves every coordinate at about the learning
        rate, so ranking by ``|m|`` keeps the coordinates with small gradients
        waiting whatever their update. (lowrank approximating ``m /
        denominator`` instead of ``m`` was measured and left out: no better.)
        Rebuilt when the variance changes (hetcomm's AdamW: on its exact
        steps); None while a parameter of the bucket has no optimizer state."""
        from . import optim

        opt = self._optimizer() if self._optimizer is not None else None
        if opt is None:
            return None
        params = [self._buckets.params.param(n) for n in bucket.sig]
        if any(p is None for p in params):
            return None
        version = tuple(optim.variance_version(opt, p) for p in params)
        cached = self._buckets.denominators.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        denominators = opt.each(params, optim.update_denominators) if isinstance(opt, Joined) else \
            optim.update_denominators(opt, params)
        if any(d is None for d in denominators):
            return None
        out = _as_bucket(bucket, buf, denominators, params, 1.0)  # (1 where the bucket has padding)
        self._buckets.denominators[key] = (version, out)
        return out

"""Gradient clipping by the norm of the gradient the ranks reduced, not of
what a lossy codec handed the optimizer.

``torch.nn.utils.clip_grad_norm_`` after a compressed step measures the
handed gradient: with onebit or top-k of an attached optimizer's momentum
that is the gradient plus the error feedback being repaid, whose norm runs
1.1-2x the gradient's on the language model of ``hetcomm bench train``; a
run clipped at a threshold near the usual norm is then clipped on more
steps, and harder, than fp32 would be (bench/README.md, "Gradient
clipping"). :meth:`hetcomm.HookState.clip_grad_norm_` clips by the norm of
the *reduced* gradient instead, the one fp32's all-reduce would have handed
over: exact for the buckets reduced exactly or through fp16/bf16/fp8 (their
handed gradient is it, within the wire's rounding), estimated for the
buckets of a lossy step (onebit, int3, topk, lowrank, a compressed momentum).

The estimate is a count sketch (Charikar, Chen, Farach-Colton 2002): each
rank's hook adds its local gradient of those buckets, as it enters the
reduction, into ``SKETCH_SIZE`` sums with a random sign per element (entry i
of a bucket into sum ``i mod SKETCH_SIZE``, a prime, so that the entries of a
matrix's column spread over the sums; the signs seeded by the bucket's
parameters, the same on every rank). The sketch is linear, so the ranks'
sketches summed with the step's batch-size weights and loss scales are the
sketch of the reduced gradient, and its squared norm an estimate of the
reduced gradient's squared norm, unbiased over the signs, with a relative
standard deviation of about sqrt(2 / SKETCH_SIZE) (3 %: 1.6 % on the norm)
where no few entries that share a sum dominate. One sum of
``SKETCH_SIZE`` float32 values over the ranks per sketched step, started by
the step's last bucket before its own collectives (so that it moves while
that bucket is reduced) and waited for by ``clip_grad_norm_``.
"""

from __future__ import annotations

import logging
import math
import weakref
import zlib
from typing import Dict, Iterable, List, Optional, Set, Tuple, Union

import torch

from . import step_hooks

log = logging.getLogger("hetcomm")

#: Sums in the gradient-norm sketch (8 KB a step on the wire, as float32). Prime: entry i goes to sum
#: i mod SKETCH_SIZE, and with a power of two every column of a matrix 2048 (or 1024, ...) wide would land in one
#: sum, so one large column would make the estimate off by its whole weight (measured: 100 % standard deviation).
SKETCH_SIZE = 2039
#: Wire formats whose handed gradient's norm is not the reduced gradient's (their error feedback is repaid later).
LOSSY = ("onebit", "int3", "topk", "lowrank")


class NormSketch:
    """This rank's sketch of the step's lossy buckets (see the module)."""

    def __init__(self) -> None:
        self.on = False  # set by the first clip_grad_norm_: the steps after it are sketched
        self.step = -1
        self.vec: Optional[torch.Tensor] = None
        self.params: Set[int] = set()  # ids of the sketched buckets' parameters
        self.unsketched = False  # a lossy bucket of this step went by while sketching was off
        self.weight = self.scale = 1.0
        self.reduced_sq: Optional[float] = None  # the summed estimate, once computed (times the clips since)
        self.warned = False
        self.calls = 0  # clip_grad_norm_ calls so far
        self.estimated_steps = 0  # steps whose norm took the sketch's estimate
        self.clipped_step = -1  # the step clip_grad_norm_ last ran for
        self.started_step = -1  # the step whose sketch's sum the last bucket started (see message)
        #: per lossy bucket of the step: a parameter of it; and once backward is over (see probe) one of them
        #: with the first 64 values DDP left in its .grad: what the hook handed
        self.probes: List[torch.Tensor] = []
        self.handed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.warned_rescaled = False
        self._watch = False  # listening before optimizer steps for a rescaled gradient (hetcomm.step_hooks)
        self._pending: Optional[tuple] = None  # (handed and .grad values, their copy's CUDA event or None, step)

    def begin_step(self, step: int, weight: float, scale: float) -> None:
        self.step, self.vec, self.params, self.unsketched = step, None, set(), False
        self.weight, self.scale, self.reduced_sq, self.probes, self.handed = weight, scale, None, [], None

    def probe(self, param: Optional[torch.Tensor]) -> None:
        """Remembers a parameter of a lossy bucket, so that a rescaling of its
        handed gradient before ``optimizer.step()`` (torch's clip_grad_norm_
        on the handed norm) can be told (:meth:`check_rescaled`). At the
        step's first one a callback is queued on the autograd engine that
        queues another: it runs after DDP's end-of-backward callback (queued
        after this hook's call), once DDP has written the handed gradients
        into ``.grad``, and keeps 64 values of one (a copy, so that
        ``gradient_as_bucket_view=True`` is covered too). A hook call outside
        backward (DDP's join shadowing a step) probes nothing."""
        if param is None or self.warned_rescaled:
            return
        ref = weakref.ref(self)  # the callbacks must not keep the sketch alive
        if not self.probes:

            def after_ddp() -> None:
                sk = ref()
                if sk is not None:
                    sk.snapshot()

            try:
                queue = torch.autograd.Variable._execution_engine.queue_callback
                queue(lambda: queue(after_ddp))
            except RuntimeError:  # not inside a backward pass
                return
        self.probes.append(param)
        if not self._watch:
            step_hooks.listen(self)
            self._watch = True

    def _pre_step(self, optimizer) -> None:
        """Before every optimizer's step, once a lossy bucket was probed (hetcomm.step_hooks)."""
        try:
            self.check_rescaled()
        except Exception:  # a check must never break the user's step
            log.debug("hetcomm: the rescaled-gradient check failed", exc_info=True)

    def snapshot(self) -> None:
        """At the end of backward: 64 handed values of the first probed
        gradient there is (a copy on the gradient's device, no synchronisation)."""
        for param in self.probes:
            g = param.grad
            if g is not None and g.numel():
                self.handed = (param, g.detach().reshape(-1)[:64].clone())
                return

    def check_rescaled(self) -> None:
        """Before any optimizer's step: warns once if a handed gradient of a
        lossy bucket was multiplied by a factor below 1 since backward (by
        anything but clip_grad_norm_ here). 64 values are compared with those
        kept at the end of backward; on a GPU they are copied without waiting
        and judged at a later step, once the copy is done (no synchronisation
        on the step's path)."""
        self._judge_pending()
        if self.warned_rescaled or self._pending is not None or self.handed is None or self.clipped_step == self.step:
            return
        param, kept = self.handed
        g = param.grad
        if g is None or g.numel() < kept.numel() or g.device != kept.device:
            return
        now = g.detach().reshape(-1)[:kept.numel()]
        if not now.is_cuda and torch.equal(now, kept):  # not rescaled (every step of most runs): one op, not ten
            return
        pair = torch.stack([kept, now]).double()
        event = None
        if pair.is_cuda:
            host = torch.empty(pair.shape, dtype=pair.dtype, pin_memory=True)
            host.copy_(pair, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            pair = host
        self._pending = (pair, event, self.step)
        self._judge_pending()

    def _judge_pending(self) -> None:
        """Judges the last copied (handed, .grad) pair once it is on the host."""
        if self._pending is None:
            return
        pair, event, step = self._pending
        if event is not None and not event.query():
            return
        self._pending = None
        a, b = pair[0], pair[1]
        aa = float(a.dot(a))
        if self.warned_rescaled or aa == 0.0 or not math.isfinite(aa):
            return
        c = float(a.dot(b)) / aa
        if 0.0 < c < 1.0 - 1e-6 and float((b - c * a).abs().max()) <= 1e-5 * float(a.abs().max()):
            self.warned_rescaled = True
            log.warning(
                "hetcomm: after step %d, whose buckets went through a lossy codec, the handed gradients were "
                "multiplied by %.4g before optimizer.step(). If that was torch.nn.utils.clip_grad_norm_, it "
                "measured the handed gradient (the gradient plus the error feedback being repaid), not the "
                "reduced one, and clips more and harder than fp32 would: use state.clip_grad_norm_(...) "
                "(same arguments). If it was torch.amp.GradScaler.unscale_, use hetcomm.amp.GradScaler. "
                "(Warned once.)", step, c)

    def close(self) -> None:
        step_hooks.leave(self)
        self._watch = False
        self.probes, self.handed, self._pending = [], None, None

    def message(self, step: int) -> Optional[torch.Tensor]:
        """At the step's last bucket: what the ranks sum for the estimate
        (the sketch in units of the reduced gradient, then this rank's
        weight), or None where nothing was sketched. The last bucket's job
        starts that sum before its own collectives, so it moves while the
        bucket is reduced, not after backward (a 4-rank all-reduce of it
        cost 7 ms of a 75 ms step on the testbed, called from clip_grad_norm_)."""
        if not self.on or self.vec is None:
            return None
        self.started_step = step
        return torch.cat([self.vec.double() * (self.weight / self.scale),
                          torch.tensor([self.weight], dtype=torch.float64, device=self.vec.device)]).float()

    @staticmethod
    def lossy(plan, momentum) -> bool:
        """Whether the gradient handed back for this bucket differs from the reduced one by more than rounding."""
        return plan.compressed and not plan.warmup and (momentum is not None or plan.mode in LOSSY)

    def add(self, key: str, buf: torch.Tensor, params: List[Optional[torch.Tensor]],
            signs_cache: Dict[str, torch.Tensor]) -> None:
        """Adds this rank's local gradient of bucket ``key`` (before the
        engine reduces it in place) to the step's sketch."""
        n = buf.numel()
        signs = signs_cache.get(key)
        if signs is None or signs.numel() != n or signs.device != buf.device:
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            # float32 (4 bytes an element, as a residual): an int8 sign multiplies 3.5x slower
            bits = torch.randint(0, 2, (n,), generator=g, dtype=torch.int8, device="cpu")
            signs = (bits * 2 - 1).float().to(buf.device)
            signs_cache[key] = signs
        part = fold(buf.reshape(-1).float() * signs)
        self.vec = part if self.vec is None else self.vec.add_(part)
        self.params.update(id(p) for p in params if p is not None)


def fold(x: torch.Tensor) -> torch.Tensor:
    """The sketch's SKETCH_SIZE sums of the signed 1-D float32 ``x``: entry i into sum i mod SKETCH_SIZE."""
    k, n = SKETCH_SIZE, x.numel()
    full = n - n % k
    part = x[:full].view(-1, k).sum(0) if full else torch.zeros(k, dtype=torch.float32, device=x.device)
    part[:n - full] += x[full:]
    return part


def _as_list(parameters: Union[torch.Tensor, Iterable[torch.Tensor]]) -> List[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    try:
        params = list(parameters)
    except TypeError:
        raise ValueError(f"parameters must be a tensor or an iterable of tensors (model.parameters()), got "
                         f"{type(parameters).__name__}") from None
    bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
    if bad:
        raise ValueError(f"parameters must be tensors, got {bad[0]}")
    return params


def clip_grad_norm_(state, parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
    """:meth:`hetcomm.HookState.clip_grad_norm_` (documented there)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0 (inf: the norm alone, nothing clipped, as with torch), "
                         f"got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or float(norm_type) != 2.0:
        raise ValueError(f"norm_type must be 2.0: hetcomm estimates the 2-norm of the reduced gradient, got "
                         f"{norm_type!r} (use torch.nn.utils.clip_grad_norm_ for other norms of the handed one)")
    given = _as_list(parameters)
    params = [p for p in given if p.grad is not None]
    if state._step_open:
        raise RuntimeError("hetcomm: clip_grad_norm_ was called while the step's buckets are being reduced: call it "
                           "after backward() returns, before optimizer.step()")
    sk: NormSketch = state._sketch
    sk.on = True
    sk.calls += 1
    last = state.iter - 1
    sketched = sk.params if sk.step == last else set()
    if sk.step == last and sk.unsketched and not sk.warned:
        sk.warned = True
        log.warning("hetcomm: clip_grad_norm_ was first called after step %d, whose compressed buckets were not "
                    "sketched: that step is clipped by the handed gradient's norm; the steps from the next on by "
                    "the reduced gradient's", last)
    # (a parameter DDP left without a gradient, one no rank used this step, is given all the same: its zeros are
    # in its bucket's sketch)
    ids = {id(p) for p in given}
    missing = len(sketched - ids)
    if missing:
        raise ValueError(f"parameters must hold every parameter of the compressed buckets (model.parameters()): "
                         f"hetcomm estimates the norm of whole buckets, and {missing} of them are missing")
    if not params:
        return torch.tensor(0.0)
    device = params[0].grad.device
    exact = [p.grad for p in params if id(p) not in sketched]
    sq = torch.zeros((), dtype=torch.float64, device=device)
    if exact:  # torch's own norm (a step with nothing sketched gets torch's total norm to the bit)
        sq = sq + torch.nn.utils.get_total_norm(exact, 2.0, foreach=foreach).double().square()
    if sketched:
        if sk.reduced_sq is None:
            # the step's last bucket started the sum (every rank's did: the step sketched something)
            assert sk.started_step == last, (sk.started_step, last)
            total = state._engine.finish_sum().wait().double()
            sk.reduced_sq = float(total[:-1].square().sum() / total[-1].square())
            sk.estimated_steps += 1
        sq = sq + sk.reduced_sq
    total_norm = sq.sqrt().float()
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"The total norm of the reduced gradient is non-finite ({total_norm.item()}), so it "
                           "cannot be clipped; to clip anyway pass error_if_nonfinite=False")
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm, foreach=foreach)
    sk.clipped_step = last
    if sketched and sk.reduced_sq is not None:  # a second call in the same step sees the clipped gradient
        coef = min(1.0, max_norm / (total_norm.item() + 1e-6))
        sk.reduced_sq *= coef * coef
    return total_norm

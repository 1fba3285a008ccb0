"""HookState: the options and the per-run state of :func:`hetcomm.hook`."""

from __future__ import annotations

import logging
import math
import weakref
from datetime import timedelta
from typing import Any, Dict, Literal, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import buckets, clip, options, plan
from .options import COMPRESSED, COMPRESSIONS, Algorithm, Compression  # noqa: F401 (public names)
from .hooks import BucketSteps, optimizer_beta
from .negotiation import Negotiation

_STATE_DICT_VERSION = options.STATE_DICT_VERSION
log = logging.getLogger("hetcomm")
#: With an Adam attached, every this many compressed steps one is exact (attach_optimizer's default).
EXACT_EVERY = 16
#: attach_optimizer(total_steps=N): the first this fraction of the run is the warm-up, the gradient reduced
#: without momentum compression (attach_optimizer's ``warmup_fraction`` default; README).
WARMUP_FRACTION = 0.2


class HookState(BucketSteps, Negotiation):
    r"""State and options of :func:`hetcomm.hook`, the DDP communication hook.

    ``ddp.register_comm_hook(HookState(...), hetcomm.hook)`` makes DDP reduce
    each gradient bucket on hetcomm's comm thread, in FIFO order, with the
    chosen wire format. Construct it on every rank, after
    ``torch.distributed.init_process_group`` and with the same arguments:
    differing options are a ``ValueError`` on every rank at the first step.

    Args:
        compression: wire format of each bucket.
            ``"none"``: fp32 all-reduce (bit-identical to PyTorch's
            ``allreduce_hook`` when batch sizes are equal).
            ``"fp16"`` / ``"bf16"``: divide by the weight, cast, all-reduce in
            the 16-bit format, cast back.
            ``"auto-precision"``: bf16 when every rank's device supports it
            natively (CPU, or CUDA with compute capability >= 8.0), else fp16;
            decided collectively at the first step.
            ``"fp8"``: the same two phases with 8-bit codes (fp8 e4m3, a
            power-of-two scale per chunk, worker and server error feedback),
            about 16 bits per element on the wire; each value is within 1/16
            of itself (or 1/229376 of its chunk's largest) and error feedback
            repays the rest. Computed with integer/float math on any device
            (no fp8 hardware needed).
            ``"onebit"``: two-phase 1-bit all-reduce (sign + scale per chunk,
            worker and server error feedback), about 2 bits per element on the
            wire instead of 64.
            ``"topk"``: each rank sends its ``topk_ratio`` largest entries of
            gradient + residual, all-gathered, at 4 bytes an entry: a 16-bit
            index inside its block of 2^16 elements (with a count per block)
            and a bf16 value, whose rounding the residual keeps (float32
            values at ``topk_ratio=1``: lossless).
            ``"lowrank"``: PowerSGD-style: each matrix-shaped gradient M is sent
            as P = M Q and Q = M^T P (P orthonormalised, Q warm-started across
            steps, error feedback); vectors and small matrices go dense in one
            all-reduce. Every collective runs on the comm thread in order, so
            any number of buckets works on gloo.
            ``"auto"``: per bucket, whichever of the wire formats that converge
            like fp32 with the attached optimizer (``candidates``) and the
            algorithms that apply finishes first: ranked by the cost model,
            verified by timing the best few (fp32 included) in the first
            compressed steps, agreed across ranks, re-checked every 1000
            compressed steps (see :mod:`hetcomm.plan`).
        process_group: group to reduce over. ``None`` (default) creates a new
            group over all ranks with the default backend, so hetcomm's
            collectives never interleave with DDP's own (buffer broadcasts,
            ``find_unused_parameters``) or the user's. Creating it is a
            collective: construct the state on every rank.
        start_iter: steps reduced in fp32 before compression starts. None
            (the default): 1, and 2 for ``"auto"`` (whose trial needs DDP's
            final buckets, rebuilt after the first iteration). The first
            step exact sets an Adam's second moment from the true gradient;
            0 compresses that step too (what a rebuilt bucket's parameters
            were owed is adopted, lowrank's Q starts afresh): as good with
            SGD, 40-120 % more steps with AdamW (bench/README "Compressed from
            the first step"). ``"auto"`` needs >= 2.
        error_feedback: keep what compression did not send and add it to the
            next step's gradient (default True). ``False`` exists to show why
            it matters.
        chunk_size: elements per 1-bit or fp8 scale (a positive multiple of
            32); ``None`` (default): 32 for onebit (its scales travel as
            bf16), 256 for fp8 (a long chunk's scale serves its small values
            badly: ``planner.DEFAULT_CHUNK``).
        min_compress_numel: buckets with fewer elements go uncompressed (fp32).
        topk_ratio: fraction of entries top-k sends, in (0, 1].
        topk_exact: exact top-k selection (default) or, with ``False``, the
            sampled-threshold selection of DGC (about k entries, faster).
        matrix_approximation_rank: lowrank's rank r (P and Q have r columns),
            as in PyTorch's PowerSGD; ``rank`` is its deprecated old name.
        lowrank_wire: what lowrank's two all-reduces send: ``"fp32"``
            (default) or ``"bf16"``, half the bytes. The bf16 sums are
            rounded; each rank's error feedback keeps what its share of the
            rounded sum missed (on the dense parts too), so nothing is lost,
            only sent a step later.
        algorithm: how each bucket's sum is computed. ``None`` (default):
            ``"auto"`` with ``compression="auto"``, else ``"native"``, except
            that with fp8, onebit, topk or lowrank on several nodes of the
            same number (> 1) of ranks the compressed buckets go
            ``"hierarchical"``: exact inside a node, compressed across nodes
            only (lowrank: its factors P and Q summed inside each node, then
            across; the nodes from the hostnames or ``HETCOMM_NODE``, nothing
            probed; ``stats()["plans"]`` says "across nodes"). ``"native"``
            (the process group's own all-reduce; given, it compresses every
            rank's exchange), ``"ring"`` (ranks grouped
            by node), ``"halving_doubling"``, ``"tree"``, ``"hierarchical"``
            (exact inside nodes; with fp8/onebit/topk only the inter-node stage is
            compressed: on one node nothing is, a warning says so; ring and
            hierarchical learn which ranks share a node from their hostnames
            or ``HETCOMM_NODE``, nothing is probed) or ``"auto"``: the planner
            of :mod:`hetcomm.planner` picks per bucket from the measured topology (0.6-0.7 s of probing
            at the first step on 2 x 2 ranks at 100 Mbit, 1.8-2.1 s on 4 x 4;
            cached per cluster for a day). ``HETCOMM_ALGO`` overrides the planner.
        transport: ``"auto"`` (default): CUDA buckets go over hetcomm's own
            NCCL communicator and comm stream when this build has CUDA
            (``build_info()["cuda"]``) and the process group moves CUDA
            tensors with NCCL; everything else over the process group (gloo
            with CUDA tensors, e.g. ranks sharing a GPU, which NCCL refuses:
            hetcomm copies them through host memory). ``"pg"``: always the
            process group. One state serves the buckets of one device.
        candidates: ``compression="auto"`` only: the modes it may choose from
            (``"none"``, ``"fp16"``, ``"bf16"``, ``"fp8"``, ``"onebit"``, ``"topk"``,
            ``"lowrank"``). Default: fp32 and bf16 (fp16 where a device lacks
            bf16); fp8 unless an Adam is attached; onebit, topk and lowrank
            only when listed here (measured to miss fp32's quality at fp32's
            learning rate or to sit at the tolerance's edge: onebit on digits,
            topk and lowrank on the language model).
        timeout: how long a collective of hetcomm's own group may wait before
            it fails (a dead peer is an error, not a hang). ``None`` takes the
            default group's timeout.

    Batch-size weighting: call :meth:`set_local_batch_size` before every step
    (starting before the first) on every rank, and the reduced gradient is
    ``sum_i b_i g_i / sum_i b_i``: ranks with different batch sizes give exactly
    the full-batch gradient. It costs one 8-byte all-reduce per step. Without
    it, gradients are averaged over ranks.

    Mixed precision (fp16 with loss scaling, or each rank in its own
    precision): create a :class:`hetcomm.amp.GradScaler` with this state on
    every rank; the hook then reduces unscaled gradients and every rank skips
    the same overflow steps.

    Save ``state_dict()`` per rank (residuals are per rank) next to the model
    and optimizer to resume a run bit for bit.
    """

    def __init__(
        self,
        compression: Compression = "none",
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        start_iter: Optional[int] = None,
        error_feedback: bool = True,
        chunk_size: Optional[int] = None,
        min_compress_numel: int = 8192,
        topk_ratio: float = 0.01,
        topk_exact: bool = True,
        matrix_approximation_rank: int = 4,
        lowrank_wire: Literal["fp32", "bf16"] = "fp32",
        algorithm: Optional[Algorithm] = None,
        transport: Literal["auto", "pg"] = "auto",
        timeout: Optional[timedelta] = None,
        candidates: Optional[Sequence[str]] = None,
        rank: Optional[int] = None,
    ) -> None:
        opts = options.validate(compression, start_iter, error_feedback, chunk_size, min_compress_numel, topk_ratio,
                                topk_exact, matrix_approximation_rank, algorithm, transport, timeout, process_group,
                                rank, candidates, lowrank_wire)
        self.compression: str = opts["compression"]
        self.start_iter: int = opts["start_iter"]
        self.error_feedback: bool = opts["error_feedback"]
        self.chunk_size: Optional[int] = opts["chunk_size"]
        self.min_compress_numel: int = opts["min_compress_numel"]
        self.topk_ratio: float = opts["topk_ratio"]
        self.topk_exact: bool = opts["topk_exact"]
        self.matrix_approximation_rank: int = opts["matrix_approximation_rank"]
        self.lowrank_wire: str = opts["lowrank_wire"]
        self.algorithm: str = opts["algorithm"]
        #: algorithm left to its default with a compressed mode: the first step decides from the nodes
        #: (negotiation); _across_nodes: its compressed buckets then run hierarchically
        self._algorithm_default = algorithm is None and self.compression in COMPRESSED
        self._across_nodes = False
        self.transport: str = opts["transport"]
        self.candidates: Optional[tuple] = opts["candidates"]
        #: The cluster's topology: measured for algorithm or compression "auto"; for "ring",
        #: "hierarchical" or a compressed mode's default the nodes only (no links, ``source`` "discover")
        #: unless a cached or given one applies.
        self.topology = None
        self._planner = plan.Planner(self)
        #: each bucket's plan in the last complete step (state key -> BucketPlan)
        self.last_plans: Dict[str, plan.BucketPlan] = {}
        self._step_plans: Dict[str, plan.BucketPlan] = {}
        #: Steps completed (a step ends with the hook call for DDP's last bucket).
        self.iter = 0
        #: time.monotonic() of the last bucket's hook call: this rank's backward
        #: compute was done then (what follows is waiting for the others).
        self.last_bucket_time: Optional[float] = None
        #: CUDA buckets: (step, event recorded on the backward stream at the
        #: last bucket's hook call): the GPU's compute was done when it fired.
        self.last_bucket_event: Optional[tuple] = None
        #: The wire format "auto-precision" settled on at the first step.
        self.resolved_compression: Optional[str] = None if compression == "auto-precision" else compression

        self._process_group = process_group
        self._placement: Optional[Tuple[int, int]] = None  # (rank, world size) in the group, kept past close()
        self._closed = False
        self._timeout = timeout
        self._engine: Optional[Any] = None
        self._buckets = buckets.BucketStates()
        self._forced_algo: Optional[str] = None  # HETCOMM_ALGO, as agreed at the first step
        self._beta: Optional[float] = None  # the momentum hetcomm compresses (attach_optimizer)
        self._saved_beta: Optional[float] = None  # the beta of a loaded state_dict's momentum
        #: a loaded state_dict's start_iter when its run was past it: the schedule a resumed run keeps
        self._resumed_start: Optional[int] = None
        self._optimizer: Optional[Any] = None  # a weak reference to the attached optimizer
        self._lr_source: Optional[Any] = None  # a weak reference to the optimizer whose rate is followed
        #: The followed optimizer's learning rates (per group) that error feedback's state is in units of
        self._lrs: Optional[list] = None
        self._lr_warned = False  # groups whose rates moved by different factors: said once
        self._attached: Optional[str] = None  # the kind of optimizer attached (options.ATTACHED)
        self._exact_every = 0  # Adam attached: every this many steps is exact, besides start_iter + 2**j - 1
        self._total_steps: Optional[int] = None  # attach_optimizer(total_steps=): the run warms up (auto may send 1 bit)
        self._warmup_compression = "none"  # attach_optimizer(warmup_compression=): the warm-up's wire
        self._warmup_fraction: Optional[float] = None  # attach_optimizer(warmup_fraction=): the warm-up's share
        self._replaying: Optional[list] = None  # (bucket, future) of a step being regrouped
        self._nonfinite_seen = 0
        self._scaler: Optional[Any] = None  # a weak reference to this rank's hetcomm.amp.GradScaler
        self._loss_scale = 1.0  # the scale the engine divides this rank's buckets by
        self._sketch = clip.NormSketch()  # clip_grad_norm_'s estimate of the reduced gradient's norm
        self._steps_done = 0  # steps reduced by this state object (iter, unlike it, is restored by load_state_dict)
        #: This rank's compute precision (its hetcomm.amp.GradScaler's), None without one.
        self.precision: Optional[str] = None
        #: Every rank's precision, gathered at the first step.
        self.precisions: Optional[list] = None
        self._local_batch: Optional[float] = None
        self._last_batch: Optional[float] = None  # the latest batch size set (a joined rank's weight, see hooks)
        self._join_steps = 0  # steps this rank shadowed inside DDP's join (its inputs ran out)
        self._joined = False  # the open step is one of them
        self._weighted: Optional[bool] = None  # decided at the first step
        self._step_open = False
        self._negotiated = False
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("hetcomm: HookState needs torch.distributed to be initialized first: call "
                               "torch.distributed.init_process_group(...) (or run under torchrun), then HookState(...)")
        self._rank_and_world()  # makes the group of its own (process_group None); close() keeps these

    # ---- public API ----------------------------------------------------------
    def set_local_batch_size(self, batch_size: int) -> None:
        """This rank's number of samples in the coming step (> 0). Call it on
        every rank before every step, starting before the first one. (Inside
        ``ddp.join()`` a rank whose inputs ran out calls nothing: the steps DDP
        shadows for it are weighed as DDP divides, see the README.)"""
        if not options._is_number(batch_size) or not (math.isfinite(batch_size) and 0 < batch_size <= 2**40):
            raise ValueError(f"batch_size must be a number in (0, 2**40] (samples in this rank's step), got "
                             f"{batch_size!r}")
        if self._weighted is False:
            raise RuntimeError(
                "set_local_batch_size was first called after the first step; call it on every rank before the "
                "first backward so all ranks agree on batch-size weighting")
        self._local_batch = self._last_batch = float(batch_size)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *,
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
        difference (noisier, smaller steps). ``exact_every`` must be 0 or None
        with SGD. With an Adam, top-k sends the momentum's entries with the
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

        Nothing to retune: keep the optimizer, its learning rate and betas.
        With loss scaling use :class:`hetcomm.amp.GradScaler` (torch's hands
        the hook scaled gradients: the momentum would mix scales).
        """
        if self._negotiated:
            raise RuntimeError("attach_optimizer must be called before the first step, on every rank")
        self._check_lr_source(optimizer, "attach_optimizer")
        from . import optim

        adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, optim.AdamW))
        if isinstance(optimizer, torch.optim.SGD):
            if any(float(g.get("dampening", 0.0)) != 0.0 for g in optimizer.param_groups):
                raise ValueError("optimizer: dampening must be 0 for momentum compression")
        elif not adam:
            raise ValueError(f"optimizer must be a torch.optim.SGD with momentum, hetcomm.optim.AdamW, "
                             f"torch.optim.Adam or torch.optim.AdamW, got {type(optimizer).__name__}")
        beta, what = optimizer_beta(optimizer, adam, "optimizer")
        if not 0.0 < beta < 1.0:
            raise ValueError(f"optimizer {what} must be in (0, 1) to be compressed, got {beta}")
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
        self._optimizer = self._lr_source = weakref.ref(optimizer)
        self._exact_every = (EXACT_EVERY if exact_every is None else exact_every) if adam else 0
        self._attached = ("hetcomm-adamw" if isinstance(optimizer, optim.AdamW) else "adam") if adam else "sgd"
        if isinstance(optimizer, optim.AdamW):
            ref = weakref.ref(self)
            optimizer._exact = lambda: (lambda s: s is None or s._last_step_exact())(ref())
        return self

    def follow_lr(self, optimizer: torch.optim.Optimizer) -> "HookState":
        """Keep error feedback in the units of ``optimizer``'s learning rate
        when the gradient itself is compressed (no :meth:`attach_optimizer`,
        which does this for the optimizer it attaches). Call on every rank
        before the first step; returns the state. Only each group's ``lr`` is
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
        self._check_lr_source(optimizer, "follow_lr")
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list) or not groups or not all(
                isinstance(g, dict) and isinstance(g.get("lr"), (int, float, torch.Tensor)) for g in groups):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer whose param_groups each have an 'lr', got "
                             f"{type(optimizer).__name__}")
        self._lr_source = weakref.ref(optimizer)
        return self

    def _check_lr_source(self, optimizer, who: str) -> None:
        followed = self._lr_source() if self._lr_source is not None else None
        if followed is not None and followed is not optimizer:
            raise ValueError(f"{who}: optimizer is not the one whose learning rate this state already follows "
                             f"({type(followed).__name__}); one HookState follows one optimizer")

    def _attach_scaler(self, scaler) -> None:
        """Called by :class:`hetcomm.amp.GradScaler`: the hook reduces this
        rank's buckets divided by the scaler's loss scale."""
        if self._negotiated:
            raise RuntimeError("hetcomm.amp.GradScaler must be created before the first step, on every rank")
        held = self._scaler() if self._scaler is not None else None
        if held is not None and held is not scaler:
            raise RuntimeError("this HookState has a hetcomm.amp.GradScaler already: one per HookState")
        self._scaler = weakref.ref(scaler)
        self.precision = scaler.precision

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for a model reduced by this
        state: clips the gradients by the norm of the gradient the ranks
        reduced, the one fp32's all-reduce would hand over, not of what a
        lossy codec handed back (onebit or top-k of an attached optimizer's
        momentum hand the gradient plus the error feedback being repaid: on
        the language model of ``hetcomm bench train`` torch's clipping of it
        left onebit+m (SGD) 4.7 % and topk+m (AdamW) 7.6 % over clipped
        fp32's perplexity, hetcomm's 1.4 % and 2.4 %; README).
        Call it on every rank after ``backward()``, before the optimizer's
        step (after ``scaler.unscale_(optimizer)`` with a GradScaler), with
        ``parameters`` holding every parameter of the DDP model
        (``model.parameters()``); returns the total norm, as torch's does.

        Buckets reduced exactly (or through fp16, bf16, fp8) count with their
        handed gradient; those of a lossy step with an estimate of the reduced
        gradient's norm from a sketch of each rank's local gradient (one sum
        of 8 KB over the ranks per step; relative error of the norm about
        1.6 %; :mod:`hetcomm.clip`). Sketching starts at the first call: call
        it from the first step on (the steps before ``start_iter`` are exact
        anyway). Parameters outside the DDP model count with their local
        gradient, as with torch. ``norm_type`` must be 2."""
        return clip.clip_grad_norm_(self, parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    def _reduced_param(self, p: torch.Tensor) -> bool:
        """Whether the hook reduces ``p``'s gradient (a parameter of the DDP model)."""
        return self._buckets.params.holds(p)

    def state_dict(self) -> Dict[str, Any]:
        """Residuals, lowrank Q matrices, compressed momentum, the last step's
        bucket layout and the step counter of this rank (waits for queued work)."""
        self._drain()
        return {
            "version": _STATE_DICT_VERSION,
            "compression": self.compression,
            "resolved_compression": self.resolved_compression,
            "iter": self.iter,
            "start_iter": self.start_iter,
            "rank": self._rank(),
            "world_size": self._world(),
            **self._buckets.state_dict(),
            "auto": self._planner.state_dict(),
            "clip_sketch": self._sketch.on,
            "lrs": self._lrs,
            "momentum_beta": self._beta,
        }

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved on this rank. A state saved
        at or after its ``start_iter`` keeps that ``start_iter`` (see
        :meth:`attach_optimizer`): compression goes on where it was, whatever
        warm-up this state was constructed or attached with."""
        if not isinstance(sd, dict) or sd.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"state_dict is not a hetcomm HookState state (version {_STATE_DICT_VERSION})")
        if sd["compression"] != self.compression:
            raise ValueError(f"state_dict compression {sd['compression']!r} != this state's {self.compression!r}")
        if sd["rank"] != self._rank() or sd["world_size"] != self._world():
            raise ValueError(
                f"state_dict was saved by rank {sd['rank']} of {sd['world_size']}, this is rank {self._rank()} of "
                f"{self._world()}: load each rank's own state")
        self._drain()
        self.iter = int(sd["iter"])
        saved_start = sd.get("start_iter")  # (None from a state saved before it was kept)
        self._resumed_start = int(saved_start) if saved_start is not None and self.iter >= saved_start else None
        if self._resumed_start is not None and self._resumed_start != self.start_iter:
            log.info("hetcomm: resumed at step %d, past the saved start_iter %d: kept (this state's: %d)",
                     self.iter, self._resumed_start, self.start_iter)
            self.start_iter = self._resumed_start
        if sd.get("resolved_compression") is not None:
            self.resolved_compression = sd["resolved_compression"]
        self._buckets.load_state_dict(sd, keyed_elsewhere=bool(sd.get("auto", {}).get("decided")))
        self._planner.load_state_dict(sd.get("auto", {}))
        self._sketch.on = self._sketch.on or bool(sd.get("clip_sketch", False))  # a resumed run sketches at once
        self._lrs = list(sd["lrs"]) if sd.get("lrs") is not None else None
        # the beta the saved momentum was kept with (a scheduled momentum moves it); attach_optimizer takes it too
        self._saved_beta = float(sd["momentum_beta"]) if sd.get("momentum_beta") is not None else None
        if self._beta is not None and self._saved_beta is not None:
            self._beta = self._saved_beta

    def stats(self) -> Dict[str, Any]:
        """Bytes and time of the last complete step and of the whole run:
        ``bytes_sent`` / ``bytes_recv`` (algorithmic, the ring-equivalent volume
        of each collective), ``fp32_bytes`` (what an fp32 ring all-reduce of the
        same buckets sends), ``compression_ratio``, ``comm_s`` (inside
        collectives), ``codec_s`` (compressing and decompressing), ``numel``,
        ``buckets``, ``collectives`` (the collective calls made: an all-reduce
        or a point-to-point step, one each; every one waits for the ranks it
        joins); plus ``iter`` and the ``compression`` in use; ``join_steps``
        once this rank has shadowed steps inside DDP's join (its inputs ran out)."""
        out: Dict[str, Any] = {"iter": self.iter, "compression": self.resolved_compression or self.compression}
        if self._engine is not None:
            out.update(self._engine.stats())
        out["precisions"] = self.precisions
        out["plans"] = {k: {"mode": p.mode, "algorithm": p.algorithm, "why": p.why, "predicted_s": p.predicted_s}
                        for k, p in self.last_plans.items()}
        if self._join_steps:
            out["join_steps"] = self._join_steps
        if self._sketch.calls:
            out["clip"] = {"calls": self._sketch.calls, "estimated_steps": self._sketch.estimated_steps}
        if self.compression == "auto":
            pl = self._planner
            out["auto"] = {"modes": list(pl.modes), "round_step_s": pl.round_times, "rechecks": pl.rechecks,
                           "next_check": pl.next_check, "compressed_steps": pl.compressed_steps,
                           "buckets": pl.describe()}
        return out

    def close(self) -> None:
        """Finish queued work, stop the comm thread and let go of the process
        group, so that ``destroy_process_group()`` frees it now (a group that
        lives on to interpreter exit can abort the process there). The state's
        ``stats()`` and ``state_dict()`` still work; reducing does not."""
        if self._engine is not None:
            self._engine.close()
        self._sketch.close()
        self._closed = True
        self._process_group = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- used by the hook ------------------------------------------------------
    def _compressed_at(self, step: int) -> bool:
        """Whether step ``step``'s compressed-mode buckets are compressed: from
        ``start_iter`` on, except, with an Adam attached, steps
        ``start_iter + 2**j - 1`` and ``start_iter + k * exact_every - 1``."""
        t = step - self.start_iter
        if t < 0:
            return False
        every = self._exact_every
        adam = self._attached in ("hetcomm-adamw", "adam")
        return not (adam and ((t & (t + 1)) == 0 or (every and (t + 1) % every == 0)))

    def _last_step_exact(self) -> bool:
        """Whether the last complete step sent no bucket through a lossy codec
        (onebit, topk, lowrank; fp8 outside the warm-up): what an attached
        hetcomm.optim.AdamW is applying."""
        return not any(p.compressed and not p.warmup for p in self.last_plans.values())

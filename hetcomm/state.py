"""HookState: the options and the per-run state of :func:`hetcomm.hook`."""

from __future__ import annotations

import math
import numbers
import os
import weakref
from datetime import timedelta
from typing import Any, Dict, Literal, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import buckets, clip, discards, options, plan
from .options import CASTS, COMPRESSED, COMPRESSIONS, Algorithm, Compression  # noqa: F401 (public names)
from .attach import OptimizerLink
from .hooks import BucketSteps
from .lowrank_rounds import RoundsTrial
from .lowrank_ladder import DEFAULT_RANK, RankLadder
from .lowrank_share import LowrankShare
from .negotiation import Negotiation, destroy_own_group, inside_c10d
from .own_steps import OwnSteps
from .state_io import StateIO
from .unused import UnusedParams


class HookState(OptimizerLink, BucketSteps, Negotiation, StateIO):
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
            the 16-bit format, cast back (on several nodes, by default, the
            float32 sum inside each node cast once and summed in 16 bits
            across the nodes only: ``algorithm``).
            ``"auto-precision"``: bf16 when every rank's device supports it
            natively (CPU, or CUDA with compute capability >= 8.0), else fp16;
            decided collectively at the first step.
            ``"fp8"``: the same two phases with 8-bit codes (fp8 e4m3, a
            power-of-two scale per chunk, worker and server error feedback),
            about 16 bits per element on the wire; each value is within 1/16
            of itself (or 1/229376 of its chunk's largest) and error feedback
            repays the rest. Computed with integer/float math on any device
            (no fp8 hardware needed).
            ``"int3"``: the same two phases with 3-bit codes: per chunk
            (default 32) the scale max|x| / 3 in bf16 and each value rounded
            to one of -3..3 times it, worker and server error feedback; about
            7 bits per element on the wire (0.43x fp8's). A value under a
            sixth of its chunk's largest goes as 0 and waits in the residual;
            the gradient so compressed reached fp32's quality under SGD with
            momentum and AdamW (bench/README "A 3-bit wire"); ``"auto"``
            offers it where it offers fp8 for the gradient.
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
            compressed steps (see :mod:`hetcomm.autoplan`).
        process_group: group to reduce over. ``None`` (default) creates a new
            group over all ranks with the default backend, so hetcomm's
            collectives never interleave with DDP's own (buffer broadcasts,
            ``find_unused_parameters``) or the user's. Creating it is a
            collective: construct the state on every rank.
        start_iter: steps reduced in fp32 before compression starts. None
            (the default): 1. The first step exact sets an Adam's second
            moment from the true gradient; 0 compresses that step too (what
            a rebuilt bucket's parameters were owed is adopted, lowrank's Q
            starts afresh): as good with SGD, 40-120 % more steps with AdamW
            (bench/README "Compressed from the first step"). ``"auto"``
            needs >= 1: its trial measures DDP's buckets as rebuilt in the
            second step (with ``static_graph=True`` in the third: a trial
            begun before starts again). Counted, with every exact step of
            ``attach_optimizer``, in a bucket's own steps: the steps its
            parameters required a gradient in (``requires_grad=False``, as
            Lightning's ``toggle_optimizer`` sets, does not count;
            :mod:`hetcomm.own_steps`), so a GAN's two models in one DDP
            model each take their first steps exact.
        error_feedback: keep what compression did not send and add it to the
            next step's gradient (default True). ``False`` exists to show why
            it matters.
        chunk_size: elements per 1-bit, fp8 or int3 scale (a positive
            multiple of 32); ``None`` (default): 32 for onebit and int3 (their
            scales travel as bf16), 256 for fp8 (a long chunk's scale serves
            its small values badly: ``planner.DEFAULT_CHUNK``).
        min_compress_numel: buckets with fewer elements go uncompressed (fp32).
        topk_ratio: fraction of entries top-k sends, in (0, 1].
        topk_exact: exact top-k selection (default) or, with ``False``, the
            sampled-threshold selection of DGC (about k entries, faster).
        matrix_approximation_rank: lowrank's rank r (P and Q have r columns),
            fixed, as in PyTorch's PowerSGD; ``rank`` is its deprecated old
            name. ``None`` (default): ``compression="lowrank"`` runs rank 16
            until step 30, then the smallest of 4, 8, 16 that carries 99 % of
            every rank's gradient energy in steps 20-30, else 16
            (:class:`hetcomm.lowrank_ladder.RankLadder`; ``stats()
            ["lowrank_rank"]``); auto's lowrank candidate has rank 4 (16
            until its first reading: ``candidates``).
        lowrank_wire: what lowrank's two all-reduces send: ``"bf16"``,
            half of ``"fp32"``'s bytes, or ``"fp8"``, about a quarter (8-bit
            codes and a scale per 256, summed as the fp8 mode sums a bucket:
            across nodes only on several nodes). The rounded sums lose
            nothing: each rank's error feedback keeps what its share of them
            missed (on the dense parts too), sent a step later. Measured
            against ``"fp32"`` (bf16) and bf16 (fp8) on the tasks of ``bench
            train``, no loss of accuracy; bf16 takes a third off lowrank's
            step where the link binds, fp8 up to half again at 10-30 Mbit/s
            (README). ``None`` (default): bf16, or fp8 across nodes whose
            link measured under 40 Mbit/s, every rank on the CPU
            (:func:`hetcomm.plan.lowrank_wire_by_default`; compression="auto"
            measures the link, a fixed mode does not); ``stats()
            ["lowrank_wire"]`` says which.
        algorithm: how each bucket's sum is computed. ``None`` (default):
            ``"auto"`` with ``compression="auto"``, else ``"native"``, except
            that with fp8, int3, onebit, topk, lowrank, fp16, bf16 or
            auto-precision on several nodes of the same number (> 1) of ranks
            the buckets go ``"hierarchical"``: exact inside a node, compressed
            (or cast to 16 bits: the node's float32 sum rounded once) across
            nodes only (lowrank: its factors P and Q summed inside each node,
            then across; the nodes from the hostnames or ``HETCOMM_NODE``,
            nothing probed; ``stats()["plans"]`` says "across nodes"), a
            compressed mode's exact steps in fp32 over the same hierarchy
            (buckets under ``min_compress_numel`` on the group's own). ``"native"``
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
            bf16); fp8 unless an Adam is attached; with no optimizer attached,
            lowrank under a guard: measured in the trial, run at rank 16
            until the ranks' first reading of how much of their gradient
            rank 4 carries (steps 20-30), then at rank 4 once a reading
            admits it, dropped when it or a later reading does not, taken
            back when a later one does
            (:class:`hetcomm.lowrank_guard.Guard`; with
            ``matrix_approximation_rank`` given, at that rank and only once
            admitted); onebit and topk only when
            listed here (measured to miss fp32's quality at fp32's learning
            rate or to sit at the tolerance's edge: onebit on digits, topk on
            the language model). Listed here, lowrank is unguarded.
        pack: the onebit, fp8 and int3 messages compressed losslessly with zstd
            (the system's libzstd, loaded at run time; where a rank lacks it,
            raw): the same bits in fewer bytes where the codes are peaked (int3's
            bit planes on digits and the wide MLP: 0.61-0.68x; its whole
            messages on digits with a rank a node, 0.70-0.80x; fp8's across
            nodes on digits 0.62x, on the wide MLP 0.84x), for the codec's time
            and one small all-gather a round. ``None`` (default): on the host
            across nodes, unless the measured link between them is faster than
            :data:`hetcomm.plan.PACK_BELOW_GBIT`, fp8 and int3 buckets.
            ``True``: every onebit, fp8 and int3 bucket; ``False``: none.
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
    and optimizer to resume a run bit for bit (``torch.distributed.checkpoint``:
    :class:`hetcomm.checkpoint.PerRank`; Lightning: its strategy; Accelerate:
    :func:`hetcomm.integrations.accelerate.register`).
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
        matrix_approximation_rank: Optional[int] = None,
        lowrank_wire: Optional[Literal["fp32", "bf16", "fp8"]] = None,
        algorithm: Optional[Algorithm] = None,
        transport: Literal["auto", "pg"] = "auto",
        timeout: Optional[timedelta] = None,
        candidates: Optional[Sequence[str]] = None,
        rank: Optional[int] = None,
        pack: Optional[bool] = None,
    ) -> None:
        opts = options.validate(compression, start_iter, error_feedback, chunk_size, min_compress_numel, topk_ratio,
                                topk_exact, matrix_approximation_rank, algorithm, transport, timeout, process_group,
                                rank, candidates, lowrank_wire, pack)
        self.compression: str = opts["compression"]
        self.start_iter: int = opts["start_iter"]
        self.error_feedback: bool = opts["error_feedback"]
        self.chunk_size: Optional[int] = opts["chunk_size"]
        self.min_compress_numel: int = opts["min_compress_numel"]
        self.topk_ratio: float = opts["topk_ratio"]
        self.topk_exact: bool = opts["topk_exact"]
        self._rank_given: Optional[int] = opts["matrix_approximation_rank"]
        #: lowrank's rank: the given one, else (compression="lowrank") chosen by measurement; auto's candidate: 4
        self.matrix_approximation_rank: int = self._rank_given or DEFAULT_RANK
        self._rank_ladder = RankLadder(None if self._rank_given is None and self.compression == "lowrank" else
                                       self.matrix_approximation_rank)
        #: lowrank's rounds a step, pipelined or together: measured (hetcomm.lowrank_rounds)
        self._rounds = RoundsTrial(self.compression in ("lowrank", "auto"), self.start_iter)
        self.lowrank_wire: Optional[str] = opts["lowrank_wire"]
        self._lowrank_wire_default = "bf16"  # lowrank_wire=None's rule on the topology (plan.lowrank_wire_by_default)
        self.pack: Optional[bool] = opts["pack"]
        self._packed_modes: tuple = ()  # pack=None's rule on the topology (negotiation: plan.packed_by_default)
        self.algorithm: str = opts["algorithm"]
        #: algorithm left to its default with a compressed mode or a 16-bit cast: the first step decides from
        #: the nodes (negotiation); _across_nodes: its buckets then run hierarchically
        self._algorithm_left = algorithm is None  # ("none": the first step hints at the hierarchy across nodes)
        self._algorithm_default = self._algorithm_left and self.compression in COMPRESSED + CASTS
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
        self._plans_before: Dict[str, plan.BucketPlan] = {}  # the step's before last_plans' (lowrank's rounds)
        self._step_plans: Dict[str, plan.BucketPlan] = {}
        #: Steps completed (a step ends with the hook call for DDP's last bucket).
        self.iter = 0
        #: time.monotonic() of the last bucket's hook call: this rank's backward
        #: compute was done then (what follows is waiting for the others).
        self.last_bucket_time: Optional[float] = None
        self._one_bucket_hinted = False  # (BucketSteps._hint_one_bucket: once a state)
        #: CUDA buckets: (step, event recorded on the backward stream at the
        #: last bucket's hook call): the GPU's compute was done when it fired.
        self.last_bucket_event: Optional[tuple] = None
        #: The wire format "auto-precision" settled on at the first step.
        self.resolved_compression: Optional[str] = None if compression == "auto-precision" else compression

        self._process_group = process_group
        self._own_group: Optional[int] = None  # the pid that made the group in _group() (dist.new_group), if it did
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
        #: a state_dict loaded with strict=False on its own rank: its model is compared with DDP's at the first step
        self._loose_sd: Optional[Dict[str, Any]] = None
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
        self._discards = discards.DiscardWatch()  # a reduced gradient no optimizer stepped: warned once
        self._unused = UnusedParams()  # state slots of parameters no rank used: put back after the backward
        self._own_steps = OwnSteps()  # each parameter's steps switched off: the schedule reads its bucket's own step
        self._own_exact = False  # a bucket of this step exact by its own step where the global step compresses
        self._lowrank_share = LowrankShare()  # whether lowrank's rank carries the gradient (read now and then)
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
        shadows for it are weighed as DDP divides, see the README.) Any real
        number but a bool: an int, a float, a NumPy scalar, or a one-element
        tensor (a token count, ``mask.sum()``; on a GPU reading it waits for
        the GPU)."""
        if isinstance(batch_size, torch.Tensor) and batch_size.numel() == 1 and not batch_size.is_complex() and \
                batch_size.dtype != torch.bool:
            batch_size = batch_size.item()
        elif isinstance(batch_size, numbers.Real) and not isinstance(batch_size, (int, float)):
            batch_size = float(batch_size)  # a NumPy scalar (numpy.bool_ is no numbers.Real)
        if not options._is_number(batch_size) or not (math.isfinite(batch_size) and 0 < batch_size <= 2**40):
            raise ValueError(f"batch_size must be a number in (0, 2**40] (samples in this rank's step), got "
                             f"{batch_size!r}")
        if self._weighted is False:
            raise RuntimeError(
                "set_local_batch_size was first called after the first step; call it on every rank before the "
                "first backward so all ranks agree on batch-size weighting")
        self._local_batch = self._last_batch = float(batch_size)

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
        of 8 KB over the ranks per step, started by the step's last bucket so
        that it moves while that bucket is reduced; relative error of the norm
        about 1.6 %; :mod:`hetcomm.clip`). Sketching starts at the first call:
        call it from the first step on (the steps before ``start_iter`` are
        exact anyway); a step that does not call it still sends its sketch.
        Parameters outside the DDP model count with their local gradient, as
        with torch. ``norm_type`` must be 2; ``max_norm`` ``inf`` reads the
        norm and clips nothing, as with torch."""
        return clip.clip_grad_norm_(self, parameters, max_norm, norm_type, error_if_nonfinite, foreach)

    def _reduced_param(self, p: torch.Tensor) -> bool:
        """Whether the hook reduces ``p``'s gradient (a parameter of the DDP model)."""
        return self._buckets.params.holds(p)

    def close(self) -> None:
        """Finish queued work, stop the comm thread and let go of the process
        group, so that ``destroy_process_group()`` frees it now (a group that
        lives on to interpreter exit can abort the process there); a gloo
        group the state made for itself is destroyed here (its threads and
        sockets go now, not at ``destroy_process_group()``). The state's
        ``stats()`` and ``state_dict()`` still work; reducing does not."""
        self._close(now=True)

    def _close(self, now: bool) -> None:
        if self._engine is not None:
            self._engine.close()
        self._sketch.close()
        self._discards.close()
        self._unused.close()
        self._closed = True
        group, self._process_group = self._process_group, None
        if group is not None and self._own_group == os.getpid():  # (not in a forked child: the parent's group)
            destroy_own_group(group, now)

    def __del__(self) -> None:
        try:
            # freed by the garbage collector inside c10d (new_group): its group destroyed at the next safe point
            self._close(now=not inside_c10d())
        except Exception:
            pass

    def __reduce_ex__(self, protocol):
        # copy.deepcopy and pickle: a state holds a process group and a comm thread, which neither can copy
        raise TypeError(
            "hetcomm.HookState cannot be copied or pickled (it holds a process group and a comm thread): for an EMA "
            "or other copy of a model copy ddp.module, not the DDP model whose hook it serves; for a checkpoint "
            "save state.state_dict() and load it into a new HookState")

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

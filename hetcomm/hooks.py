"""The DDP communication hook, and what it does with each bucket: open the
step (negotiate once, begin the planner's step, submit the batch weights),
plan the bucket, hand it and its per-bucket state to the comm engine; on the
first step after a restore, regroup the buckets as the saved run had them."""

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import _C, buckets, clip, ddpfind, lowrank_layout, options, plan
from .lowrank_share import THRESHOLD, LowrankShare, agreed_lowest
from .negotiation import default_group_timeout
from .options import COMPRESSED
from .plan import DENSE

log = logging.getLogger("hetcomm")

#: A step's only bucket of at least this many elements gets the one-bucket hint (BucketSteps._hint_one_bucket):
#: 512 KB of fp32, the least segment the codecs pipeline in pieces (compressed.cpp's kPieceNumel). Below it the
#: split lost: digits' MLP (85k elements) in two buckets took 1.28x one bucket's step on the 2 x 2 testbed
#: (bench/README "A model in one bucket: DDP's bucket_cap_mb").
ONE_BUCKET_HINT = 1 << 17

# The core's enums by name (pybind11 builds a new __members__ dict on every access: once here, not per bucket).
_CODECS = dict(_C.Codec.__members__)
_ALGOS = dict(_C.Algo.__members__)


def hook(state: "BucketSteps", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp.register_comm_hook(state, hetcomm.hook)``.

    Queues the bucket on the state's comm thread and returns at once; the
    Future completes with the reduced bucket (in place) once every rank has
    contributed. Buckets are reduced in the order DDP hands them over, the same
    on every rank. See :class:`hetcomm.HookState` for the options.
    """
    if not isinstance(state, BucketSteps):
        raise ValueError(f"hetcomm.hook: state must be a hetcomm.HookState, got {type(state).__name__}")
    if isinstance(bucket, torch.Tensor):  # FSDP's hooks hand over a tensor (fully_shard's set_all_reduce_hook)
        raise ValueError("hetcomm.hook: bucket must be DDP's GradBucket (register the hook with "
                         "DistributedDataParallel.register_comm_hook), got a tensor: FSDP's hooks "
                         "(FullyShardedDataParallel.register_comm_hook, fully_shard's set_all_reduce_hook) are not "
                         "supported")
    return state._submit(bucket)


#: A joined rank's batch size when DDP's join divides by the ranks still training
#: (``divide_by_initial_world_size=False``): its zero gradient then weighs nothing, and the others' divisor is
#: their own samples (engine divisors must be finite and > 0: total / 1e-20 is, in float32, for any total <= 2**40).
_NO_SAMPLES = 1e-20


class BucketSteps:
    """The per-bucket half of :class:`hetcomm.HookState` (which holds the
    options, the engine, the planner and the per-bucket state it uses)."""

    def _submit(self, grad_bucket) -> torch.futures.Future:
        buf = grad_bucket.buffer()
        if buf.layout != torch.strided:
            raise ValueError(
                f"hetcomm.hook: this bucket holds a sparse gradient ({buf.layout}: an nn.Embedding or EmbeddingBag "
                "with sparse=True); hetcomm reduces dense buckets only: construct it with sparse=False (its gradient "
                "is then reduced, and compressed, as the others)")
        if not buf.is_floating_point():
            raise ValueError(f"hetcomm.hook: bucket dtype must be floating point, got {buf.dtype}")
        engine = self._ensure_engine(buf.device)
        bucket = buckets.from_grad_bucket(grad_bucket, self._buckets.params, buf)
        if not self._step_open:
            if not self._negotiated:
                self._check_ddp_group(grad_bucket.parameters())
            if self._loose_sd is not None:
                self._check_loose_load(grad_bucket.parameters())
            self._open_step(engine, buf.device)
            if self._buckets.replay_layout is not None:
                self._replaying = []
        if self._replaying is not None:
            return self._collect(bucket, engine)
        return self._reduce(bucket, engine)

    def _check_ddp_group(self, params) -> None:
        """First step, before any collective: the DDP model these buckets come
        from must reduce over the same ranks as this state's group."""
        if ddpfind.every_group_spans_the_world():
            return  # DDP's group spans every rank, and so does this state's (the heap search costs ~100 ms)
        ddp = ddpfind.owning_ddp(params[0]) if params else None
        if ddp is None or getattr(ddp, "process_group", None) is None:
            return
        theirs = dist.get_process_group_ranks(ddp.process_group)
        ours = dist.get_process_group_ranks(self._group())
        if sorted(theirs) != sorted(ours):
            raise ValueError(
                f"hetcomm: DDP reduces over ranks {theirs} (its process_group) but this HookState over {ours}: "
                "pass HookState(process_group=ddp.process_group) when DDP runs on a subgroup")

    def _open_step(self, engine, device: torch.device) -> None:
        if not self._negotiated:
            self._negotiate(device)
        self._joined = self._shadow_join()  # a walk up this thread's stack: microseconds, once a step
        self._step_open = True
        self._planner.auto.begin_step(engine)
        if self._rank_ladder.pending and LowrankShare.closes(self.iter - 1):
            self._choose_rank(engine)
        if self._rounds.pending or self._rounds.unmeasured:
            # a step counts where it ran lowrank alone, with the plans of the step before it, and read no share: a
            # step after a switch pays for it (under auto's trial on digits int3 across nodes took 7.43 ms a step
            # after int3 flat, 5.79 as the run's plan: bench/README "lowrank's rounds, fixed for a run; a re-check's
            # steps after a switch"), a reading step for the reading (under auto steps 20 and 25 of the first window,
            # 11-30, fell to together and 30 to pipelined: the wide model chose pipelined on 3 of 16 runs with them,
            # on none without; bench/README "lowrank's rounds: the steps a window counts")
            alone = {p.mode for p in self.last_plans.values() if p.compressed} == {"lowrank"}
            if self._rounds.unmeasured and alone:
                self._rounds.reopen(self.iter)
            same = {k: (p.mode, p.algorithm) for k, p in self.last_plans.items()} == \
                {k: (p.mode, p.algorithm) for k, p in self._plans_before.items()}
            read = self._lowrank_share.read_at == self.iter - 1  # it paid for a reading of lowrank's share too
            self._rounds.open_step(self.iter, engine, alone and same and not read)
        self._buckets.begin_step(engine.carry_holds())
        if self._optimizer is not None:
            self._follow_momentum()
        if self._lr_source is not None and self.error_feedback:
            self._follow_lr()
        nonfinite = engine.nonfinite_steps()
        self._discards.check(self.iter, nonfinite)
        if nonfinite > self._nonfinite_seen:
            # Once per power of two: a diverged run has a NaN every step, and
            # GradScaler's occasional overflows are routine.
            if nonfinite.bit_length() > self._nonfinite_seen.bit_length():
                # with hetcomm's GradScaler overflow steps are expected (every rank skips them): INFO
                level = logging.INFO if self._scaler is not None else logging.WARNING
                log.log(level, "hetcomm: %d step(s) so far had non-finite gradients on some rank; they were reduced "
                        "exactly in fp32 (every rank sees the NaN/Inf, as with allreduce_hook) and left the "
                        "error-feedback state untouched (next note at %d)%s", nonfinite, 1 << nonfinite.bit_length(),
                        "" if self._scaler is not None else
                        ". If these are fp16 loss-scaling overflows, use hetcomm.amp.GradScaler: torch's hands this "
                        "hook gradients times its scale, and error feedback then mixes two scales after each backoff")
            self._nonfinite_seen = nonfinite
        if self._scaler is not None:
            # this rank's buckets hold s g: reduce g (the scale joins the divisor); a scaler dropped: s = 1
            scaler = self._scaler()
            scale = scaler.loss_scale() if scaler is not None else 1.0
            if scale != self._loss_scale:
                self._loss_scale = scale
                engine.set_loss_scale(scale)
        weight = self._local_batch if self._weighted and self._local_batch is not None else 1.0
        self._sketch.begin_step(self.iter, weight, self._loss_scale)
        if self._weighted:
            if self._local_batch is None:
                raise RuntimeError(
                    f"hetcomm: batch-size weighting is on but no batch size was set for step {self.iter}: call "
                    "state.set_local_batch_size(len(batch)) on every rank before every step (a value is used for "
                    "one step only)")
            engine.submit_batch_size(self._local_batch)
            self._local_batch = None

    def _lowrank_rank(self) -> int:
        """lowrank's rank now: auto's candidate runs at its provisional rank
        until its first reading; else the ladder's (or the given) rank."""
        return self._planner.auto.lowrank_rank() or self._rank_ladder.rank

    def _choose_rank(self, engine) -> None:
        """After a window of share readings at each rank lowrank may choose
        (:class:`hetcomm.lowrank_ladder.RankLadder`): every rank all-gathers
        its means (or -1: none, e.g. every step of it overflowed, and the next
        window decides); the lowest per rank decides, the same everywhere."""
        step = self.iter - 1
        ladder = self._rank_ladder
        last = self._lowrank_share.last
        read = last is not None and last["step"] == step and len(last.get("ladder", ())) == len(ladder.ranks)
        lowest = agreed_lowest(engine, step, last["ladder"] if read else [None] * len(ladder.ranks), "lowrank's")
        if lowest is None:
            return
        rank = ladder.choose(lowest, step)
        share = lowest[ladder.ranks.index(rank)]
        if share < THRESHOLD and engine.rank == 0 and not self._lowrank_share.warned:
            self._lowrank_share.warn(rank, share, step)

    def _shadow_join(self) -> bool:
        """Whether this step is DDP's join shadowing the others' backward for
        this rank (its inputs ran out: zero buckets, no batch size set). Its
        batch-size weight is then what DDP divides by: with
        ``divide_by_initial_world_size=True`` (the default) the latest batch
        size this rank set (its zero gradient counts as that many samples, as
        DDP counts it as a rank), with False none (the step's gradient is the
        mean over the samples of the ranks still training). Without batch
        sizes the divisor stays the world size either way, as with PyTorch's
        own hooks."""
        ddp = ddpfind.join_shadowing()
        if ddp is None:
            return False
        self._join_steps += 1
        if self._weighted and self._local_batch is None:
            even = getattr(ddp, "_divide_by_initial_world_size", True)
            self._local_batch = self._last_batch if even and self._last_batch is not None else _NO_SAMPLES
        return True

    def _collect(self, bucket: buckets.Bucket, engine) -> torch.futures.Future:
        """The first step after load_state_dict: hold DDP's buckets until the
        step's last one, then reduce the gradients grouped as in the saved
        layout (the original run's), so the restored state meets exactly the
        buckets it was made for. One step without overlap; while DDP's layout
        still differs from the saved one (``static_graph=True`` rebuilds its
        buckets a step later), the next step too, up to REPLAY_STEPS."""
        fut: torch.futures.Future = torch.futures.Future()
        bucket.grads  # its views made now, in the call DDP handed its GradBucket to
        self._replaying.append((bucket, fut))
        if not bucket.last:
            return fut
        collected, self._replaying = self._replaying, None
        target, self._buckets.replay_layout = self._buckets.replay_layout, None
        try:
            regrouped = self._replay(collected, target, engine)
        except BaseException as e:
            for _, f in collected[:-1]:
                f.set_exception(e)
            self._step_open = False
            raise
        self._buckets.replays_left -= 1
        if self._buckets.replays_left > 0 and regrouped:
            self._buckets.replay_layout = target  # DDP's initial buckets again next step, or its rebuilt ones
        for b, f in collected:
            f.set_result(b.buffer)
        return fut

    def _replay(self, collected, target, engine) -> bool:
        """Reduces the collected step in the ``target`` layout; whether its buckets had to be regrouped."""
        self._buckets.check_saved_shapes()
        real = [b for b, _ in collected]
        if [b.sig for b in real] == target:
            virtual = real  # the layout is the saved one: nothing to regroup
        else:
            views = {p: g for b in real for p, g in zip(b.sig, b.grads)}
            wanted = sorted(p for sig in target for p in sig)
            if sorted(views) != wanted:
                raise ValueError(
                    "hetcomm: the restored state's bucket layout holds other parameters than this step's buckets "
                    f"({len(wanted)} vs {len(views)}): load the state saved with this model and these DDP options")
            virtual = []
            for i, sig in enumerate(target):
                flat = torch.cat([views[p].reshape(-1) for p in sig])
                grads, off = [], 0
                for p in sig:
                    n = views[p].numel()
                    grads.append(flat[off:off + n].view(views[p].shape))
                    off += n
                virtual.append(buckets.Bucket(i, flat, grads, sig, i == len(target) - 1))
        for fut in [self._reduce(b, engine) for b in virtual]:
            fut.wait()
        if virtual is not real:
            for b in virtual:
                for p, g in zip(b.sig, b.grads):
                    views[p].copy_(g)
        return virtual is not real

    def _own_step(self, bucket: buckets.Bucket, numel: int) -> int:
        """The step the schedule reads for this bucket: its parameters' own
        (hetcomm.own_steps; the global step where none was switched off).
        Where that departs from the global step's plan, the ranks compare it."""
        if (self.resolved_compression or self.compression) in DENSE:  # (auto-precision: fp16 or bf16)
            return self.iter
        own = self._own_steps.step(bucket.sig, self._buckets.params.param, self.iter)
        if own == self.iter or numel < self.min_compress_numel:
            return own
        at, usual = self._planner.schedule(own), self._planner.schedule(self.iter)
        if at != usual:
            self._own_exact = self._own_exact or usual == "c"  # auto: a step not wholly compressed
            self._own_steps.agree(self._group(), f"{self.iter}/{bucket.index}", at,
                                  self._timeout or default_group_timeout())
        return own

    def _hint_one_bucket(self, numel: int, itemsize: int, p) -> None:
        """A step of one bucket (the step's first is its last): a model DDP
        holds whole in its first bucket (1 MiB by default), whose exchange
        starts only once backward has ended. From ONE_BUCKET_HINT elements,
        compressed or on several nodes, after DDP's rebuild (step 1 on), the
        ``hetcomm`` logger says so once at INFO on rank 0, naming DDP's
        ``bucket_cap_mb`` (README "A model in one bucket")."""
        if self._one_bucket_hinted or self.iter < 1 or numel < ONE_BUCKET_HINT:
            return
        if not (p.compressed or (self.topology is not None and self.topology.num_nodes > 1)):
            return
        self._one_bucket_hinted = True
        if self._rank() == 0:
            mb = numel * itemsize / 2 ** 20
            log.info("hetcomm: DDP hands this model's whole gradient over in one bucket (%.2f MB), so its exchange "
                     "starts only once backward has ended; DDP(..., bucket_cap_mb=%.2g) (about half of it) sends "
                     "the first part while backward computes the rest, where the ranks have CPU to spare for a second "
                     "exchange (README \"A model in one bucket\")", mb, mb / 2)

    def _reduce(self, bucket: buckets.Bucket, engine) -> torch.futures.Future:
        buf = bucket.buffer
        numel = buf.numel()
        key = buckets.key_of(bucket.sig)
        self._buckets.add_to_step(bucket.sig)
        node_of = self.topology.node_ids if self.topology is not None else []
        # a bucket of a new layout (DDP's rebuild) takes over what the old buckets' error feedback owed
        self._buckets.adopt(bucket.sig, key, numel, buf.device, engine.size, engine.rank, node_of)
        at_rank = self._lowrank_rank()

        def layout_of(rank: Optional[int] = None) -> torch.Tensor:  # lowrank's, cached per bucket (another rank's not)
            if rank is None or rank == at_rank:
                return self._buckets.lowrank_parts(bucket, key, at_rank)
            return lowrank_layout.matrix_layout(bucket, rank)

        p = self._planner.plan(numel, key, bucket.index, self._own_step(bucket, numel), layout_of)
        self._step_plans[key] = p
        layout = q_state = None
        if p.mode == "lowrank":
            layout = layout_of()
            q_state = self._buckets.lowrank_q_state(key, layout, buf.device)
        if self._planner.auto.reads_at(self.iter) and (
                p.mode == "lowrank" or (self._planner.auto.reads_share(numel) and self._compressed_at(self.iter))):
            if p.mode == "lowrank" and self._rank_ladder.pending:  # at every rank it may choose, at once
                ranks = self._rank_ladder.ranks
                self._lowrank_share.add(buf, layout_of(ranks[0]), ranks)
            else:  # how much of the gradient lowrank's rank can carry (auto's: at its rank after the reading, and 8)
                at = self._rank_ladder.rank
                self._lowrank_share.add(buf, layout_of(at), self._planner.auto.read_ranks(at))
        residual, server, carry = self._buckets.state_for(p, key, numel, buf.device, error_feedback=self.error_feedback,
                                                          world=engine.size, rank=engine.rank, node_of=node_of)
        momentum = None
        if self._beta is not None and self.compression in COMPRESSED + ("auto",) and numel >= self.min_compress_numel:
            store, sgd = self._buckets.momentum, self._attached == "sgd"
            if (sgd and self.compression == "auto" and not p.compressed) or p.warmup:
                # auto, a dense plan: no copy of the momentum (following the optimizer's buffer costs passes
                # over the bucket every step); the warm-up's compressed gradient: the optimizer makes the
                # momentum of it. The next compressed plan starts from the optimizer's buffer
                store.pop(key, None)
            else:
                if key not in store:
                    # a bucket first seen now (the first step, DDP's rebuilt buckets after it, auto's switch
                    # from a dense plan): its momentum so far is the optimizer's, the same on every rank
                    store[key] = self._optimizer_momentum(bucket, buf)
                momentum = self._buckets.residual(store, key, numel, buf.device)
        fed = (residual is not None or carry is not None or momentum is not None) and not self._joined
        if not fed:
            self._unused.forget(bucket.sig)  # its marks are this step's: a later step must not read them
        else:
            # this gradient feeds state the next steps repay (a parameter of it that requires a gradient now noted)
            self._discards.see(self.iter, map(self._buckets.params.param, bucket.sig),
                               p.mode + (" of the attached momentum" if momentum is not None else ""))
            # the state's slots of parameters this rank's backward did not reach: put back after the backward
            # where no rank used them (DDP then writes no gradient of them; hetcomm.unused)
            unused = self._unused.unused(bucket.sig, self._buckets.params.param)
            if unused:
                shard = residual is not None and residual.numel() != numel  # this rank's shard of its node's sum
                bases = _C.state_offsets(numel, engine.size, engine.rank,
                                         list(node_of) if p.algorithm == "hierarchical" else [],
                                         p.algorithm == "hierarchical") if shard or server is not None else (0, 0)
                self._unused.keep([self._buckets.params.param(n) for n in bucket.sig], bucket.grads, buf, unused,
                                  [(residual, bases[0] if shard else 0), (carry, 0), (server, bases[1]),
                                   (momentum, 0)],
                                  None if q_state is None else lowrank_layout.q_slots(bucket.grads, layout, q_state))
        if clip.NormSketch.lossy(p, momentum):  # its handed gradient's norm is not the reduced one's
            if self._joined and self._sketch.on:
                raise RuntimeError(
                    "hetcomm: this rank's inputs ran out inside DDP's join while clip_grad_norm_ estimates the "
                    "norm of compressed buckets: that estimate is a collective of the ranks still training, which "
                    "a joined rank cannot shadow; use model.join(throw_on_early_termination=True) (every rank "
                    "stops at the first one out of inputs), give every rank as many steps, or clip with torch")
            self._sketch.probe(self._buckets.params.param(bucket.sig[0]))
            if self._sketch.on:
                self._sketch.add(key, buf, [self._buckets.params.param(n) for n in bucket.sig],
                                 self._buckets.sketch_signs)
            else:
                self._sketch.unsketched = True
        denominator = None
        if momentum is not None and p.mode == "topk" and self._attached in ("hetcomm-adamw", "adam"):
            denominator = self._update_denominator(bucket, buf, key)
        fut = engine.submit_bucket(index=bucket.index, buffer=buf, codec=_CODECS[p.mode],
                                   chunk=options.chunk_for(self.chunk_size, p.mode),
                                   topk_ratio=self.topk_ratio, topk_exact=self.topk_exact, residual=residual,
                                   server_residual=server, last=bucket.last, layout=layout, q_state=q_state,
                                   algorithm=_ALGOS[p.algorithm], momentum=momentum, beta=self._beta or 0.0,
                                   carry=carry, update_denominator=denominator, pipeline=True,
                                   lowrank_wire=plan.lowrank_wire_of(self),
                                   hold=p.mode == "lowrank" and self._rounds.hold(self.iter),
                                   sum_first=self._sketch.message(self.iter) if bucket.last else None,
                                   pack=plan.packs(self, p))
        if bucket.last:
            if bucket.index == 0:
                self._hint_one_bucket(numel, buf.element_size(), p)
            self.last_bucket_time = time.monotonic()
            if buf.is_cuda:  # the host runs ahead of the GPU: time the GPU's work with an event
                event = torch.cuda.Event(enable_timing=True)
                event.record(torch.cuda.current_stream(buf.device))
                self.last_bucket_event = (self.iter, event)
            self._step_open = False
            self._planner.auto.end_step(self._compressed_at(self.iter) and not self._own_exact)
            self._own_exact = False
            self._lowrank_share.end_step(self.iter, self._rank_ladder.rank, engine.rank,
                                         warn=self._planner.auto.guard is None)
            self._plans_before, self.last_plans, self._step_plans = self.last_plans, self._step_plans, {}
            self.iter += 1
            self._steps_done += 1
            self._buckets.end_step()
            self._buckets.check_saved_shapes()
        return fut

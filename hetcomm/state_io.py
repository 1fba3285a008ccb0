"""What a :class:`hetcomm.HookState` saves and reports (a mixin of it):
``state_dict`` / ``load_state_dict`` (a rank's own state, strict or loose:
another rank, world size, compression or model takes what the ranks share
and starts the rest afresh) and ``stats``."""

from __future__ import annotations

import logging
from typing import Any, Dict

from . import _C, ddpfind, options, plan

_STATE_DICT_VERSION = options.STATE_DICT_VERSION
log = logging.getLogger("hetcomm")


class StateIO:
    def state_dict(self) -> Dict[str, Any]:
        """Residuals, lowrank Q matrices, compressed momentum, the last step's
        bucket layout, the step counter, each parameter's steps switched off,
        auto's trial and choices, lowrank's share readings, chosen rank and
        rounds of this rank (waits for queued work)."""
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
            "auto": self._planner.auto.state_dict(),
            "lowrank_share": self._lowrank_share.state_dict(),
            "lowrank_rank": self._rank_ladder.state_dict(),
            "lowrank_rounds": self._rounds.state_dict(),
            "clip_sketch": self._sketch.on,
            "lrs": self._lrs,
            "momentum_beta": self._beta,
            "off_steps": self._own_steps.state_dict(),
        }

    def load_state_dict(self, sd: Dict[str, Any], strict: bool = True) -> None:
        """Restore what :meth:`state_dict` saved on this rank. A state saved
        at or after its ``start_iter`` keeps that ``start_iter`` (see
        :meth:`attach_optimizer`): compression goes on where it was, whatever
        warm-up this state was constructed or attached with.

        ``strict=False`` also takes a state saved by another rank or another
        world size (an elastic restart on more or fewer nodes, each new rank
        loading some old rank's file), with another ``compression``, or for a
        model whose trainable parameters changed (layers unfrozen or frozen,
        DDP wrapped again: told at the first step, where DDP's parameters are
        compared with the saved shapes): it restores what the ranks share (the
        step count and ``start_iter``, so a warm-up is not run again; the
        learning rates the error feedback follows; the momentum's beta; the
        clipping sketch) and starts what each rank keeps afresh, as a new
        state would (error feedback, compressed momenta, lowrank's Q, the
        bucket layout, auto's decisions, measured again on the new topology).
        The ``hetcomm`` logger warns. For the same rank, world, compression
        and model it is the strict load."""
        if not isinstance(sd, dict) or sd.get("version") != _STATE_DICT_VERSION:
            raise ValueError(f"state_dict is not a hetcomm HookState state (version {_STATE_DICT_VERSION})")
        same_mode = sd["compression"] == self.compression
        if not same_mode and strict:
            raise ValueError(
                f"state_dict compression {sd['compression']!r} != this state's {self.compression!r}: load a state "
                "saved with this compression, or, to go on in another one, load_state_dict(sd, strict=False): the "
                "step count and warm-up carry on, error feedback starts afresh")
        same_place = sd["rank"] == self._rank() and sd["world_size"] == self._world()
        if not same_place and strict:
            raise ValueError(
                f"state_dict was saved by rank {sd['rank']} of {sd['world_size']}, this is rank {self._rank()} of "
                f"{self._world()}: load each rank's own state, or after a change of world size (an elastic "
                "restart) load_state_dict(sd, strict=False): the step count and warm-up carry on, error feedback "
                "starts afresh. (torch.distributed.checkpoint keeps one copy of what every rank saves under one key: "
                "save hetcomm.checkpoint.PerRank(state) there, each rank's state under a key of its own)")
        if not (same_place and same_mode):
            log.warning("hetcomm: state saved by rank %d of %d with compression %r loaded on rank %d of %d with %r "
                        "(strict=False): step %d and start_iter kept; error feedback, compressed momenta, lowrank's "
                        "Q and auto's decisions start afresh", sd["rank"], sd["world_size"], sd["compression"],
                        self._rank(), self._world(), self.compression, int(sd["iter"]))
        self._drain()
        self.iter = int(sd["iter"])
        saved_start = sd.get("start_iter")  # (None from a state saved before it was kept)
        self._resumed_start = int(saved_start) if saved_start is not None and self.iter >= saved_start else None
        if self._resumed_start is not None and self._resumed_start != self.start_iter:
            log.info("hetcomm: resumed at step %d, past the saved start_iter %d: kept (this state's: %d)",
                     self.iter, self._resumed_start, self.start_iter)
            self.start_iter = self._resumed_start
        if same_place and same_mode:
            if sd.get("resolved_compression") is not None:
                self.resolved_compression = sd["resolved_compression"]
            auto = sd.get("auto", {})  # auto's choices, or its running trial, per bucket key
            self._buckets.load_state_dict(sd)
            self._planner.auto.load_state_dict(auto)
            self._lowrank_share.load_state_dict(sd.get("lowrank_share", {}))
            self._loose_sd = None if strict else sd
        else:  # another rank's or mode's state: only its model's shapes (checked at the first step); the rest afresh
            self._restore_shared_only(sd, sd.get("param_shapes", []))
            self._loose_sd = sd  # (strict=False: a model whose trainable parameters changed is taken too)
        self._rank_ladder.load_state_dict(sd.get("lowrank_rank"))  # agreed by the ranks
        if self._rounds.on:
            self._rounds.load_state_dict(sd.get("lowrank_rounds"))  # agreed by the ranks
        self._sketch.on = self._sketch.on or bool(sd.get("clip_sketch", False))  # a resumed run sketches at once
        self._lrs = list(sd["lrs"]) if sd.get("lrs") is not None else None
        self._own_steps.load_state_dict(sd.get("off_steps"))  # agreed by the ranks (a model changed: see below)
        # the beta the saved momentum was kept with (a scheduled momentum moves it); attach_optimizer takes it too
        self._saved_beta = float(sd["momentum_beta"]) if sd.get("momentum_beta") is not None else None
        if self._beta is not None and self._saved_beta is not None:
            self._beta = self._saved_beta

    def _restore_shared_only(self, sd: Dict[str, Any], shapes) -> None:
        """Of a loaded state, what every rank shares for any model: each
        rank's per-bucket state starts afresh (``shapes``: the model the
        first step must meet, [] for any)."""
        self._buckets.load_state_dict({"param_shapes": shapes})
        self._planner.auto.load_state_dict({"guard": sd.get("auto", {}).get("guard", {})})  # agreed by the ranks
        self._lowrank_share.load_state_dict({})

    def _check_loose_load(self, params) -> None:
        """The first step after ``load_state_dict(sd, strict=False)`` on the
        rank that saved it: where DDP's trainable parameters are no longer
        the saved model's (a layer unfrozen, DDP wrapped again), the per-bucket
        state, numbered by the old model's parameters, starts afresh, before
        anything of the step ran. DDP is found from a parameter (once); where
        it is not, the shapes are checked after the step as a strict load's."""
        sd, self._loose_sd = self._loose_sd, None
        saved = self._buckets.saved_shapes()
        ddp = ddpfind.owning_ddp(params[0]) if params and saved else None
        if ddp is None:
            return
        # (DDP's own list leaves out the parameters it was told to ignore; torch 2.13)
        params = getattr(ddp, "_module_parameters", None) or list(ddp.parameters())
        shapes = [tuple(p.shape) for p in params if p.requires_grad]
        if sorted(shapes) == sorted(saved):
            return
        log.warning("hetcomm: the state loaded with strict=False was saved for a model with %d trainable parameters, "
                    "DDP now has %d (layers unfrozen or frozen): step %d and start_iter kept; error feedback, "
                    "compressed momenta, lowrank's Q and auto's decisions start afresh",
                    len(saved), len(shapes), self.iter)
        self._restore_shared_only(sd, [])
        self._own_steps.load_state_dict(None)  # (numbered by the old model's parameters)

    def stats(self) -> Dict[str, Any]:
        """Bytes and time of the last complete step and of the whole run:
        ``bytes_sent`` / ``bytes_recv`` (algorithmic, the ring-equivalent volume
        of each collective), ``fp32_bytes`` (what an fp32 ring all-reduce of the
        same buckets sends, 4 bytes a value whatever the parameters' dtype:
        mode none on bf16 parameters reads 2), ``compression_ratio``, ``comm_s`` (inside
        collectives), ``codec_s`` (compressing and decompressing), ``numel``,
        ``buckets``, ``collectives`` (the collective calls made: an all-reduce
        or a point-to-point step, one each; every one waits for the ranks it
        joins), ``bytes_sent_across_nodes`` / ``bytes_recv_across_nodes`` (of
        those bytes, what went to / came from ranks on other nodes, the slow
        links: a node is a hostname or ``HETCOMM_NODE``; a message of
        hetcomm's own algorithms by its peer, a backend's collective, as the
        native all-reduce, by its share of peers off the node),
        ``packed_rounds`` / ``unpacked_rounds`` (rounds offered for packing,
        ``pack``, that went zstd-packed / raw: raw where a rank lacks libzstd
        or the packed blocks were no shorter), every count 0 before the
        first bucket (``compression_ratio`` 1.0 where nothing was sent); plus ``iter``
        and the ``compression`` in use; ``attached`` (the kind of optimizer
        whose momentum is compressed: ``"sgd"``, ``"adam"``, ``"hetcomm-adamw"``)
        once :meth:`attach_optimizer` was called; ``join_steps`` once this rank has
        shadowed steps inside DDP's join (its inputs ran out);
        ``lowrank_share`` once lowrank (or auto's guard on it) measured how much
        of this rank's gradient its rank carries (:mod:`hetcomm.lowrank_share`:
        steps 20-30, 50-60, 80-90, 100-120, 200-220, 400-420, ...); ``lowrank_rank`` under
        ``compression="lowrank"`` (the rank in use; with
        ``matrix_approximation_rank`` left to lowrank, whether it is chosen
        yet, the ranks' lowest shares at 4 / 8 / 16 and the step they were
        read at); ``lowrank_rounds`` under ``"lowrank"`` and ``"auto"`` (lowrank's
        buckets' rounds a step, pipelined or together, as measured in steps
        11-30: :mod:`hetcomm.lowrank_rounds`) and ``lowrank_wire`` (what
        its factors are sent as: the option, or its default's choice) under
        both; ``auto`` under
        ``compression="auto"``, with ``lowrank_guard`` (pending, admitted or
        refused; the ranks' last agreed reading, the one that set the state,
        the first, and how often a reading took a refused lowrank back) where
        auto offers lowrank, and ``lowrank_rank`` (the rank its
        lowrank runs at now) where lowrank is among its modes."""
        out: Dict[str, Any] = {"iter": self.iter, "compression": self.resolved_compression or self.compression}
        # (before the first bucket there is no engine: its counts are 0, so that stats()["last_step"] reads alike)
        out.update(self._engine.stats() if self._engine is not None else _C.stats_before_any_step())
        out["precisions"] = self.precisions
        if self._attached is not None:
            out["attached"] = self._attached
        out["plans"] = {k: {"mode": p.mode, "algorithm": p.algorithm, "why": p.why, "predicted_s": p.predicted_s}
                        for k, p in self.last_plans.items()}
        if self._join_steps:
            out["join_steps"] = self._join_steps
        if self._lowrank_share.last is not None:
            out["lowrank_share"] = dict(self._lowrank_share.last)
        if self.compression == "lowrank":
            out["lowrank_rank"] = self._rank_ladder.describe()
        if self._rounds.on:
            out["lowrank_rounds"] = self._rounds.describe()
            out["lowrank_wire"] = plan.lowrank_wire_of(self)
        if self._sketch.calls:
            out["clip"] = {"calls": self._sketch.calls, "estimated_steps": self._sketch.estimated_steps}
        if self.compression == "auto":
            pl = self._planner.auto
            out["auto"] = {"modes": list(pl.modes), "round_step_s": pl.round_times, "rechecks": pl.rechecks,
                           "confirms": pl.confirms, "next_check": pl.next_check, "confirm_at": pl.confirm_at,
                           "compressed_steps": pl.compressed_steps,
                           "buckets": pl.describe()}
            if pl.guard is not None:
                out["auto"]["lowrank_guard"] = pl.guard.state_dict()
            if "lowrank" in pl.modes:  # the rank its lowrank runs at now (16 until the guard's first reading)
                out["auto"]["lowrank_rank"] = self._lowrank_rank()
        return out

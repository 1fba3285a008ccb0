"""``compression="auto"``: each bucket's plan by *predict, then verify*.

1. Candidates per bucket: every (wire, algorithm) pair allowed for the user's
   optimizer (:func:`safe_modes`), ranked by the cost model on the measured
   topology; the best few (``AUTO_TOP``) plus fp32 on the process group's own
   all-reduce (the "never loses" baseline) are kept.
2. Trial: the first compressed steps after ``start_iter`` run rounds in turn,
   ``AUTO_REPEATS`` times each. Round 0 runs each bucket's first candidate
   (its best predicted; in a re-check its plan as it runs), then one round per
   (mode, algorithm): every bucket that offers it runs it, the others their
   first (:meth:`AutoPlanner._orders`: a step's buckets share the links, so
   rounds pair their candidates by name, not by each one's prediction).
   (From step 1, in the buckets DDP rebuilt in that step's forward; where it
   rebuilds them later, ``static_graph=True``, a first trial begun in the
   old buckets starts again in the new: :meth:`AutoPlanner._drop_replaced`.)
   In the first trial, after round 0 (each bucket's best predicted
   candidate; the guarded lowrank only where it is predicted fastest and
   may run now, see 5) and each round of its first cycle after it, the
   ranks agree on the rounds still to run whose predicted communication
   alone is over ``AUTO_SPAN`` times the fastest round's step so far (a
   round of fp32 alone, which runs no codec: ``AUTO_LINK_SPAN``, 1.25);
   those do not run at all (:meth:`AutoPlanner._skip_hopeless`). After the first
   cycle (each round once) the ranks agree on the rounds that took over
   ``AUTO_SPAN`` times the fastest; those run no more (fp32 at 100 Mbit: 3
   steps of it cost 25 compressed ones; they could not win), nor do those
   no faster in it than the round the decision keeps (3), which cannot
   replace it (``AUTO_DROP_SLOWER``; a round with the guarded lowrank
   against one without it runs on: its margin decides); where only that
   round is left, the trial ends.
   Each round's *step* time is measured (one period of the training loop:
   what the user waits for, including what the codecs and the intra-node
   traffic take from the compute on a shared CPU); the comm thread also times
   every bucket (shown in ``stats()``, not decided on: measured on the
   testbed, a bucket's own time missed 50 ms/step of such effects).
3. Decision: every rank all-gathers its round times, takes the slowest rank's
   time per round and the fastest round: the same choice everywhere, whatever
   each rank measured (:func:`choose`). The best predicted round (round 0;
   the first without the guarded lowrank where lowrank leads) stands unless
   another is ``1 / AUTO_HYSTERESIS`` faster and faster in every cycle that
   ran both (:func:`hetcomm.autotrial.faster_in_every_cycle`), as in 4.
4. Re-check (round 0: the current plans), switching only to a round at least
   ``1 / AUTO_HYSTERESIS`` faster and faster in every cycle (to a round with the guarded lowrank from
   one without it, by lowrank's margin alone, see 5): first ``AUTO_SETTLE`` compressed steps
   after the first decision (whose trial ran in the run's first steps, slower
   and noisier than the steady state: measured, it could pick a plan 10-40 %
   slower than the best; so too after a re-check, not one of lowrank alone,
   ending in the first AUTO_SETTLE), then every ``AUTO_RECHECK``, each once none of
   its steps would take a share reading of the guard's. A re-check leaves out
   the candidates its last measurement found more than ``AUTO_SPAN`` times
   slower than the chosen round (fp32 at 100 Mbit: 10x a compressed step,
   3 trial steps of it cost 25 compressed ones), except every
   ``AUTO_FULL_EVERY``-th, which measures every candidate again.
   (:mod:`hetcomm.autotrial`: the rounds, the times, the decision.)
5. lowrank, offered by default where the gradient alone is compressed, is a
   *guarded* candidate: it runs only where the ranks' readings of how much of
   their gradient its rank carries admit it, and a round with it wins only by
   a margin (:mod:`hetcomm.autoguard`).
6. Saved (:meth:`AutoPlanner.state_dict`): the choices, each bucket's
   candidates, the last trial's round order and times, a running trial's
   progress; with the share readings (``hetcomm.lowrank_share``) a resumed
   run goes on as the one that saved it, inside a trial or a window too.

A bucket's error-feedback state belongs to the plan that made it: when a
bucket's compressed plan changes, what its residuals still owe is folded into
a *carry* that the next step's reduction adds, or that joins the next
plan's residual where that is the whole bucket's (see
:meth:`hetcomm.buckets.BucketStates.state_for`), so nothing is dropped. lowrank's Q
(a warm start, not a debt) stays, and a bucket back on lowrank goes on from it.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

from . import buckets, lowrank_guard, lowrank_share, planner
from .autoguard import LOWRANK_MARGIN, PROVISIONAL_MARGIN, GuardedLowrank
from .autotrial import (AUTO_CONFIRM, AUTO_FULL_EVERY, AUTO_HYSTERESIS, AUTO_RECHECK, AUTO_REPEATS, AUTO_SETTLE,
                        AUTO_SPAN, AUTO_TOP, INF, TrialRounds, choose)
from .plan import AUTO_MODES, DENSE, BucketPlan

__all__ = ["AutoPlanner", "safe_modes", "choose", "AUTO_TOP", "AUTO_REPEATS", "AUTO_SETTLE", "AUTO_RECHECK",
           "AUTO_CONFIRM", "AUTO_HYSTERESIS", "AUTO_SPAN", "AUTO_FULL_EVERY", "INF", "LOWRANK_MARGIN",
           "PROVISIONAL_MARGIN"]

log = logging.getLogger("hetcomm")


def safe_modes(attached: Optional[str], bf16_everywhere: bool, warmed_up: bool = False) -> Tuple[str, ...]:
    """The wire formats ``auto`` may choose without the user retuning anything:
    those measured to reach fp32's quality at fp32's learning rate with this
    optimizer (README "Time to accuracy"). ``attached``: None, "sgd" (momentum
    compression of SGD), "hetcomm-adamw", or "adam" (torch's Adam/AdamW);
    ``warmed_up``: attach_optimizer(total_steps=) made the run's start a warm-up (a fifth unless warmup_fraction=)
    (its gradient exact or in fp8: onebit was measured after both)."""
    half = "bf16" if bf16_everywhere else "fp16"
    # 1-bit of the momentum, over 30 digits runs (10 seeds x lr x {1, 1 +- 1e-6}): from step 2 0.49 points short
    # with SGD-momentum and 0.26 with hetcomm's AdamW, 2 and 1 of the 3 10-seed sets outside the 0.5 tolerance;
    # with the warm-up +0.01 and -0.28, every set within (LM and regression within either way).
    onebit = ("onebit",) if warmed_up else ()
    if attached == "sgd":
        # fp8 of SGD's momentum: every task on 2 ranks (digits and the regression over 15 runs); the 4-rank LM blew
        # up in 1 of 2 seeds with 2048 values per scale, reached in 2 of 2 with 256 (the default). top-k missed the
        # language model (perplexity 2.35 against 1.62 on the 4-rank testbed): list it in candidates=.
        return ("none", half, "fp8") + onebit
    if attached == "hetcomm-adamw":
        # Adam's momentum compressed: top-k missed digits (95.7 vs 98.6 % over 3 seeds) and the LM (+11 %), fp8 into
        # the frozen variance digits (93.3 %); 1-bit only with the warm-up (above).
        return ("none", half) + onebit
    if attached is None:
        # fp8 of the gradient (error feedback, no momentum compression) reached
        # fp32 on every task with SGD-momentum and AdamW (digits over 3 seeds);
        # so did int3 (3 bits and a bf16 scale per 32: 0.43x fp8's bytes), every
        # seed of 3 on 2 ranks and on 4. The 4-rank language model with SGD-m
        # spikes at its loss drop under either as often as under fp32 itself
        # (20 seeds: fp32 4, fp8 4, int3 3): that cell's own edge of stability;
        # at 0.1, where fp32 never spiked, both reached on 10 seeds of 10
        # (bench/README "A 3-bit wire", "int3's spike, counted", "fp32 spikes
        # there too", "The edge of stability, located").
        return ("none", half, "fp8", "int3")
    # torch's Adam attached (its variance sees the codec's error): dense only.
    return ("none", half)


class AutoPlanner(TrialRounds, GuardedLowrank):
    """``compression="auto"``'s candidates, trials, decisions and lowrank
    guard for one :class:`hetcomm.plan.Planner` (``plans``: whose wires and
    cost-model algorithms it uses)."""

    def __init__(self, plans) -> None:
        self.p = plans
        self.s = plans.s
        #: per bucket key, the candidates [(mode, algorithm, predicted_s)] ...
        self.candidates: Dict[str, List[Tuple[str, str, Optional[float]]]] = {}
        #: ... and the index of the chosen one
        self.decided: Dict[str, int] = {}
        self.modes: Tuple[str, ...] = ()   # set at negotiation
        self.compressed_steps = 0          # steps where compression was on (the auto clock)
        self.trial_start: Optional[int] = None  # compressed step at which the running trial began
        self.next_check = 0
        #: per bucket key, this rank's comm-thread seconds of each candidate in the last trial
        self.measured: Dict[str, List[float]] = {}
        self._restored: Dict[str, Tuple[str, str]] = {}  # a state saved without its candidates: key -> choice
        self._unverified: set = set()  # keys whose saved candidates the first plan compares with the fresh ones
        self._replanned_at: Optional[int] = None  # the step a mismatch found there began a trial (_verify)
        self._times: Dict[str, Dict[int, List[float]]] = {}  # comm-thread seconds per bucket and candidate
        self._step_times: Dict[int, List[float]] = {}  # trial round -> step seconds
        self._order: Dict[str, List[int]] = {}  # bucket key -> candidate indices in trial-round order
        self._kept: Optional[List[int]] = None  # the rounds the trial repeats after its first cycle (once agreed)
        self._skipped: Optional[List[int]] = None  # the first trial's rounds its first cycle leaves out (as agreed)
        self._rechecking = False
        self.rechecks = 0                  # re-checks started so far
        #: the compressed step from which a re-check confirms the last one's keep (_kept_by_margin), else None
        self.confirm_at: Optional[int] = None
        self.confirms = 0                  # of the re-checks, those that confirmed one (not in the full ones' count)
        self._confirming = False           # the running re-check is one
        self.lowrank_asks = False  # the guard asked for a re-check of lowrank (admitted where none took it; back)
        self._for_lowrank = False          # the running re-check measures lowrank against the running plans alone
        #: per bucket key, the (mode, algorithm) pairs a pruned re-check leaves out
        self.pruned: Dict[str, set] = {}
        self._opened: Optional[float] = None
        self._last_round: Optional[int] = None
        #: the slowest rank's step time of each round of the last trial
        self.round_times: List[float] = []
        self._step_trial: Dict[int, Tuple[str, int]] = {}  # bucket index -> (key, candidate) of the open step
        self._last_trial: Dict[int, Tuple[str, int]] = {}
        #: lowrank's condition when auto offers it by default (set at negotiation), else None
        self.guard: Optional[lowrank_guard.Guard] = None
        self._lowrank_algo: Optional[str] = None  # the guarded lowrank's algorithm, one for every bucket
        self._guard_sd: dict = {}  # a loaded guard's state, for the guard made at negotiation

    def _candidates(self, numel: int, layout_of) -> List[Tuple[str, str, Optional[float]]]:
        s = self.s
        if s.algorithm != "auto":
            algos = [s.algorithm]
        elif s._forced_algo:
            algos = [s._forced_algo]
        else:
            algos = list(planner.ALGORITHMS)
        ranked, guarded = [], []
        for mode in self.modes:
            wire = self.p._wire(mode, numel, layout_of)
            usable = [a for a in algos if planner.carries(a, wire)] or ["native"]
            preds = [(planner.predict(s.topology, numel * 4, a, wire), a) for a in usable]
            preds = [(t, a) for t, a in preds if t is not None]
            if mode in DENSE:  # one algorithm: the predicted best
                preds = sorted(preds, key=lambda p: (p[0], planner.ALGORITHMS.index(p[1])))[:1]
            (guarded if self._guarded(mode) else ranked).extend((t, mode, a) for t, a in preds)
        ranked.sort(key=lambda r: (r[0], AUTO_MODES.index(r[1]), planner.ALGORITHMS.index(r[2])))
        top = [(m, a, t) for t, m, a in ranked[:AUTO_TOP]]
        if not any(m == "none" and a == "native" for m, a, _ in top) and "none" in self.modes:
            native = planner.predict(s.topology, numel * 4, "native", "none")
            top.append(("none", "native", native))
        # on top of the rest, where it has a matrix to compress at its rank (it may run provisionally at another)
        if guarded and bool((layout_of(self.s.matrix_approximation_rank)[:, 3] > 0).any()):
            top.append(self._guarded_candidate(guarded))
        return top

    def _guarded_candidate(self, preds: List[Tuple[Optional[float], str, str]]) -> Tuple[str, str, Optional[float]]:
        """The guarded lowrank's candidate among ``preds`` (time, mode,
        algorithm): one algorithm for every bucket, the one predicted best for
        the first bucket that had it. Two lowrank buckets' all-reduces go out
        together (a step's B buckets in two rounds, or B + 1 pipelined) only
        where they run one algorithm; bucket by bucket the prediction put the
        wide model's large bucket across nodes and its small one flat, and
        that step took 39-41 ms on the 2 x 2 testbed at 100 Mbit against
        30-32 with both across nodes (three runs each, in turns)
        (bench/README "lowrank without its M buffer")."""
        if self._lowrank_algo is None:
            self._lowrank_algo = min(preds, key=lambda p: (p[0], planner.ALGORITHMS.index(p[2])))[2]
        t, m, a = next((p for p in preds if p[2] == self._lowrank_algo), preds[0])
        return m, a, t

    def plan(self, numel: int, key: str, index: int, layout_of) -> BucketPlan:
        """A compressed step's plan under compression="auto"."""
        if key in self._unverified:
            self._unverified.discard(key)
            self._verify(key, self._candidates(numel, layout_of))
        if key not in self.candidates:
            self._drop_replaced(key)
            cands = self._candidates(numel, layout_of)
            restored = self._restored.pop(key, None)
            if restored is not None:
                self._keep(key, cands, restored)
            else:
                self.candidates[key] = cands
                if self.trial_start is None:
                    self._start_trial()
            if key not in self._order:
                self._join(key)
        cands = self.candidates[key]
        if self._in_trial():
            j = self._candidate_in_round(key, self._round())
            self._step_trial[index] = (key, j)
            mode, algo, predicted = cands[j]
            return BucketPlan(mode, algo, "trial", predicted_s=predicted)
        mode, algo, predicted = cands[self.decided.get(key, 0)]
        return BucketPlan(mode, algo, "measured" if key in self.decided else "predicted", predicted_s=predicted)

    def _drop_replaced(self, key: str) -> None:
        """A bucket first seen now whose parameters other buckets held: DDP
        rebuilt its buckets after auto began (``static_graph=True`` rebuilds
        them in the third step, not the second). What was planned and
        measured for the old buckets goes; a first trial that ran in them
        starts again, in the new ones (its rounds timed other buckets)."""
        gone = buckets.overlapping(buckets.sig_of(key), self.candidates)
        if not gone:
            return
        for k in gone:
            for per_key in (self.candidates, self.decided, self._order, self.measured, self.pruned, self._times):
                per_key.pop(k, None)
        self._step_trial = {i: kj for i, kj in self._step_trial.items() if kj[0] not in gone}
        again = self.trial_start is not None and not self.decided
        log.info("hetcomm: auto: DDP rebuilt its buckets at step %d; %s", self.s.iter,
                 "the trial starts again in them" if again else "they are planned afresh")
        if again:
            self._start_trial()

    def _verify(self, key: str, fresh: List[Tuple[str, str, Optional[float]]]) -> None:
        """A resumed bucket's first plan: its saved candidates against those
        planned now. The same (the same topology and options): the saved
        trial, times and choices go on as in the run that saved them.
        Others (another cluster, other options): the bucket keeps its choice
        among them, the saved trial's rounds and times (which named the
        other candidates) are dropped, and a trial starts now: the first
        trial again, or a re-check of the choices against the candidates of
        now."""
        if [c[:2] for c in fresh] == [c[:2] for c in self.candidates[key]]:
            return
        j = self.decided.get(key)
        if j is None:
            self.candidates[key] = fresh
        else:
            self._keep(key, fresh, self.candidates[key][j][:2])
        self.round_times = []
        if self._replanned_at == self.compressed_steps:  # a trial begun this step for another bucket: its rounds
            self._join(key)
        else:
            self._replanned_at = self.compressed_steps
            self._start_trial(full=True)  # what was measured hopeless elsewhere is measured again

    def _keep(self, key: str, cands: List[Tuple[str, str, Optional[float]]], chosen: Tuple[str, str]) -> None:
        """``key``'s candidates ``cands`` with its earlier choice ``chosen``
        (mode, algorithm) decided among them; appended where the cost model
        no longer offers it (another cluster now: the next trial verifies it)."""
        names = [c[:2] for c in cands]
        if chosen not in names:
            cands.append((*chosen, None))
            names.append(chosen)
        self.candidates[key] = cands
        self.decided[key] = names.index(chosen)

    def end_step(self, compressed: bool) -> None:
        """After the step's last bucket was submitted."""
        self._last_round = None
        if compressed and self.s.resolved_compression == "auto":
            if self._in_trial():
                self._last_round = self._round()
            self.compressed_steps += 1
        self._last_trial, self._step_trial = self._step_trial, {}

    def begin_step(self, engine) -> None:
        """Before the step's first bucket: time the last step if it was a trial
        round (from this call to the next: a whole period of the training
        loop), and its buckets on the comm thread (they are done: DDP waited);
        decide when the trial is over; start a re-check when one is due."""
        if self.s.resolved_compression != "auto":
            return
        now = time.monotonic()
        if self._last_round is not None and self._opened is not None:
            self._step_times.setdefault(self._last_round, []).append(now - self._opened)
        self._opened, self._last_round = now, None
        if self._last_trial:
            for index, secs in engine.last_step_buckets():
                if index in self._last_trial:
                    key, j = self._last_trial[index]
                    self._times.setdefault(key, {}).setdefault(j, []).append(secs)
            self._last_trial = {}
        if self.guard is not None and lowrank_share.LowrankShare.closes(self.s.iter - 1) and \
                not self.skips_reading(self.s.iter - 1):
            self._read_guard(engine)
        if self.trial_start is not None and not self._rechecking and \
                1 <= self.compressed_steps - self.trial_start < len(self._cycle()):
            self._skip_hopeless(engine)
        if self.trial_start is not None and self._kept is None and \
                self.compressed_steps - self.trial_start == len(self._cycle()):
            self._cut(engine)
        if self.trial_start is not None and not self._in_trial():
            self._decide(engine)
            self.trial_start = None
            # a trial in the run's first AUTO_SETTLE compressed steps is checked again AUTO_SETTLE steps later (early
            # steps are slower and noisier); a re-check of lowrank alone measured no other round: the schedule stays
            if not self._for_lowrank:
                self.next_check = self.compressed_steps + (AUTO_SETTLE if self.compressed_steps < AUTO_SETTLE else
                                                           AUTO_RECHECK)
            self._for_lowrank = False
            if any(self._blocked(self.candidates[k][j]) for k, j in self.decided.items()):
                self._first_trial_again()  # lowrank, refused while the trial ran, was all it measured
        elif self.trial_start is None and self.decided and (self.lowrank_asks or self.compressed_steps >= min(
                self.next_check, INF if self.confirm_at is None else self.confirm_at)) \
                and not self._reads_during(AUTO_REPEATS * max(map(len, self._orders().values()), default=1)):
            self._start_trial()  # re-check: the rounds again, the current plans first; then the hysteresis rule

    # ---- what is saved ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The choices, and what a resumed run needs to go on as this one
        would: each bucket's candidates, the last trial's round order and
        times (lowrank admitted later takes the fastest round they allow),
        a running trial's progress and step times, the guard."""
        out = {"decided": {k: list(self.candidates[k][j][:2]) for k, j in self.decided.items()},
               "compressed_steps": self.compressed_steps, "next_check": self.next_check,
               "rechecks": self.rechecks, "confirm_at": self.confirm_at, "confirms": self.confirms,
               "lowrank_asks": self.lowrank_asks,
               "pruned": {k: sorted(map(list, v)) for k, v in self.pruned.items() if v},
               "candidates": {k: [list(c) for c in v] for k, v in self.candidates.items()},
               "order": {k: list(v) for k, v in self._order.items()}, "round_times": list(self.round_times)}
        if self.trial_start is not None:
            out["trial"] = {"start": self.trial_start, "rechecking": self._rechecking, "confirming": self._confirming,
                            "for_lowrank": self._for_lowrank,
                            "kept": self._kept, "skipped": self._skipped,
                            "step_times": {c: list(v) for c, v in self._step_times.items()}}
        if self.guard is not None:
            out["guard"] = self.guard.state_dict()
        if self._lowrank_algo is not None:
            out["lowrank_algorithm"] = self._lowrank_algo
        return out

    def load_state_dict(self, sd: dict) -> None:
        self.compressed_steps = int(sd.get("compressed_steps", 0))
        self.next_check = int(sd.get("next_check", 0))
        self.rechecks = int(sd.get("rechecks", 0))
        self.confirm_at = None if sd.get("confirm_at") is None else int(sd["confirm_at"])
        self.confirms, self._confirming = int(sd.get("confirms", 0)), False
        self.lowrank_asks, self._for_lowrank = bool(sd.get("lowrank_asks", False)), False
        self.pruned = {str(k): {tuple(c) for c in v} for k, v in sd.get("pruned", {}).items()}
        self.candidates, self.decided, self.trial_start, self._times, self._order = {}, {}, None, {}, {}
        self._restored, self._unverified, self.round_times, self._step_times, self._kept = {}, set(), [], {}, None
        self._skipped = None
        saved = sd.get("candidates")
        if saved is None:  # (a state saved before its candidates were): the choices, verified by a new trial
            self._restored = {str(k): tuple(v) for k, v in sd.get("decided", {}).items()}
        else:  # as saved; each bucket's first plan compares them with its candidates then (_verify)
            self.candidates = {str(k): [(str(m), str(a), t) for m, a, t in v] for k, v in saved.items()}
            self.decided = {str(k): [c[:2] for c in self.candidates[k]].index(tuple(v))
                            for k, v in sd.get("decided", {}).items()}
            self._order = {str(k): [int(j) for j in v] for k, v in sd.get("order", {}).items()}
            self.round_times = [float(t) for t in sd.get("round_times", [])]
            self._unverified = set(self.candidates)
            trial = sd.get("trial")
            if trial is not None:
                self.trial_start, self._rechecking = int(trial["start"]), bool(trial["rechecking"])
                self._confirming = bool(trial.get("confirming", False))
                self._for_lowrank = bool(trial.get("for_lowrank", False))
                self._kept = None if trial["kept"] is None else [int(c) for c in trial["kept"]]
                self._skipped = None if trial.get("skipped") is None else [int(c) for c in trial["skipped"]]
                self._step_times = {int(c): [float(t) for t in v] for c, v in trial["step_times"].items()}
        self._lowrank_algo = sd.get("lowrank_algorithm")  # (a rebuilt bucket's prediction may differ: kept as saved)
        self._guard_sd = sd.get("guard", {})
        if self.guard is not None:
            self.guard.load_state_dict(self._guard_sd)

    def describe(self) -> Dict[str, dict]:
        """Per bucket key: the candidates, their predictions and the choice."""
        out = {}
        for k, cands in self.candidates.items():
            j = self.decided.get(k)
            seen = self.measured.get(k, [None] * len(cands))
            out[k] = {"candidates": [{"mode": m, "algorithm": a, "predicted_s": t, "comm_s": w,
                                      "pruned": (m, a) in self.pruned.get(k, ())}
                                     for (m, a, t), w in zip(cands, seen)],
                      "chosen": None if j is None else {"mode": cands[j][0], "algorithm": cands[j][1]}}
        return out

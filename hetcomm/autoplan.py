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
   may run now, see 5), the ranks agree on the rounds whose predicted
   communication alone is over ``AUTO_SPAN`` times round 0's step; those do
   not run at all (:meth:`AutoPlanner._skip_hopeless`). After the first
   cycle (each round once) the ranks agree on the rounds that took over
   ``AUTO_SPAN`` times the fastest; those run no more (fp32 at 100 Mbit: 3
   steps of it cost 25 compressed ones; they could not win).
   Each round's *step* time is measured (one period of the training loop:
   what the user waits for, including what the codecs and the intra-node
   traffic take from the compute on a shared CPU); the comm thread also times
   every bucket (shown in ``stats()``, not decided on: measured on the
   testbed, a bucket's own time missed 50 ms/step of such effects).
3. Decision: every rank all-gathers its round times, takes the slowest rank's
   time per round and the fastest round: the same choice everywhere, whatever
   each rank measured (:func:`choose`).
4. Re-check (round 0: the current plans), switching only to a round at least
   ``1 / AUTO_HYSTERESIS`` faster (to a round with the guarded lowrank from
   one without it, by lowrank's margin alone, see 5): first ``AUTO_SETTLE`` compressed steps
   after the first decision (whose trial ran in the run's first steps, slower
   and noisier than the steady state: measured, it could pick a plan 10-40 %
   slower than the best; so too after a re-check that ended inside the first
   AUTO_SETTLE compressed steps), then every ``AUTO_RECHECK``, each once none of
   its steps would take a share reading of the guard's. A re-check leaves out
   the candidates its last measurement found more than ``AUTO_SPAN`` times
   slower than the chosen round (fp32 at 100 Mbit: 10x a compressed step,
   3 trial steps of it cost 25 compressed ones), except every
   ``AUTO_FULL_EVERY``-th, which measures every candidate again.
5. lowrank, offered by default where the gradient alone is compressed, is a
   *guarded* candidate (:class:`hetcomm.lowrank_guard.Guard`): the trial
   measures it; until the ranks' first reading of how much of their
   gradient its rank carries (steps 20-30) it runs only at rank 16
   (provisionally, where ``matrix_approximation_rank`` is left to hetcomm;
   given, not at all), then only once a reading admits it (a reading under
   the bar but over the lower one, or under the lower one where rank 8
   carries the gradient, waits for the next windows, 50-60, 80-90,
   100-120, lowrank going on at rank 16 where it ran provisionally, at 8
   where rank 8 carries as much as the bar asks of rank 4; the first at
   the bar admits it, 100-120 under it refuses it); admitted,
   every bucket takes the fastest round the last trial measured, lowrank's
   included, and where none takes lowrank, a re-check measures it at once
   at the rank it now runs at (the trials timed it at 16). A round with the guarded lowrank wins only at
   ``LOWRANK_MARGIN`` (0.7) times the best round without it or less: an
   approximation must buy a clear speed-up. While it runs provisionally the
   margin is ``PROVISIONAL_MARGIN`` (0.9): the reading decides again by the
   full one, and where lowrank's round did not meet that, its admission
   takes the round without it and measures lowrank again at once. A
   re-check that keeps a round without the admitted lowrank by its margin
   alone (lowrank's round measured faster, not by the margin) is confirmed
   by another ``AUTO_CONFIRM`` steps later, once
   (:meth:`AutoPlanner._kept_by_margin`). Where the cost model predicts
   it fastest (a slow link) and it may run, it is the first trial's round
   0, so that the rounds hopeless against it do not run: a skipped round's
   predicted communication alone is over AUTO_SPAN times lowrank's step, so
   it loses even by the margin unless the probe overrated its time 1.4-fold
   (its bandwidth was 0.88-1.0x the link's). On the wide model at 100 Mbit
   the first trial ran lowrank and fp8 across nodes, where it had run fp8
   and bf16 across nodes, fp8 flat, then lowrank (bench/README "auto's
   start"). Refused (then or later), it leaves the candidates, and buckets
   that ran it take the fastest round without it; where the last trial
   measured none (the others hopeless against lowrank), the first trial runs
   again without lowrank. The guard reads on: a later window at its bar
   takes lowrank back, and a re-check measures it (the trials since the
   refusal left it out) once none of its steps would take a reading.
   Wherever it leads some bucket's order, its round (on every bucket that
   offers it: lowrank's buckets send their all-reduces together) is the first
   trial's round 0 or a re-check's round 1.

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
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

from . import buckets, lowrank_guard, lowrank_share, planner
from .plan import AUTO_MODES, DENSE, BucketPlan

log = logging.getLogger("hetcomm")

AUTO_TOP = 3          # candidates by prediction kept for the trial (plus fp32 native)
AUTO_REPEATS = 3      # trial steps per candidate, interleaved (the minimum counts: the first may warm up)
AUTO_SETTLE = 100     # compressed steps from the first decision to the first re-check
AUTO_RECHECK = 1000   # compressed steps between later re-checks
AUTO_CONFIRM = 20     # compressed steps to a re-check that confirms one kept from the admitted lowrank by its margin
AUTO_HYSTERESIS = 0.9  # a re-check switches only to a candidate this much faster than the current one
AUTO_SPAN = 2.0       # re-checks leave out candidates measured this much slower than the chosen one ...
AUTO_FULL_EVERY = 4   # ... except every 4th re-check, which measures them all again
INF = float("inf")     # a round's time where there is none (not measured, or not allowed)
# the guarded lowrank's round wins only at this fraction of the best round's time without it, or less: lowrank is
# an approximation that can cost steps where fp8 is all but exact (digits at 100 Mbit, where their steps took about
# as long: lowrank 220 steps to fp32's accuracy against fp8's 120 on one AdamW seed of three, more steps on two of six
# before), and it won where the link binds by far more (the wide model at 100 Mbit: 0.3-0.45x fp8's step). A
# threshold between the two, not fitted (bench/README "auto's lowrank at rank 16 until its reading")
LOWRANK_MARGIN = 0.7
# ... and this one while it runs provisionally (before its guard's reading; at rank 16, or 8 while it waits), which
# the reading decides again by LOWRANK_MARGIN (an admitted lowrank that won by this alone is measured again at once,
# at its rank then). The trial's one-step rounds time it above its steady step (it follows another plan's step):
# on the wide model at 100 Mbit rank 16 took 0.66x int3's step over 200 steps and read 0.83-0.86x in first trials,
# so int3 ran steps 11-30 on 9 runs of 20 (bench/README "The provisional lowrank's own margin")
PROVISIONAL_MARGIN = 0.9


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


def choose(times: Sequence[Sequence[float]], current: Optional[int] = None,
           hysteresis: float = AUTO_HYSTERESIS) -> int:
    """The candidate to keep, from ``times[rank][candidate]`` (seconds; inf
    where not measured): the one whose slowest rank is fastest (ties: the
    earlier, better-predicted one). With a ``current`` choice, switch only to
    one at least ``1 / hysteresis`` times faster."""
    worst = [max(col) for col in zip(*times)]
    best = min(range(len(worst)), key=lambda j: (worst[j], j))
    if current is not None and worst[best] > hysteresis * worst[current]:
        return current
    return best


class AutoPlanner:
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
        self._skipped: Optional[List[int]] = None  # the first trial's rounds its first cycle leaves out (once agreed)
        self._rechecking = False
        self.rechecks = 0                  # re-checks started so far
        #: the compressed step from which a re-check confirms the last one's keep (_kept_by_margin), else None
        self.confirm_at: Optional[int] = None
        self.confirms = 0                  # of the re-checks, those that confirmed one (not in the full ones' count)
        self._confirming = False           # the running re-check is one
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

    def offer_guarded(self) -> None:
        """Negotiation: lowrank joins the candidates under its guard."""
        self.modes += ("lowrank",)
        self.guard = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK if self.s._rank_given is None else None)
        self.guard.load_state_dict(self._guard_sd)

    def reads_share(self, numel: int) -> bool:
        """Whether a compressed step's bucket of ``numel`` elements feeds the
        guard's reading (the bucket one lowrank would take; refused too: a
        reading at ADMIT takes it back)."""
        return self.guard is not None and numel >= self.s.min_compress_numel

    def skips_reading(self, step: int) -> bool:
        """Whether the guard leaves ``step``'s window unread: admitted, it
        skips the windows before LATER (50-60, 80-90: they are for a guard
        between its bars or refused; admitted, the windows from LATER on may
        drop it, at DROP). Each such reading took 25-35 ms of a wide-model step
        on the 2 x 2 testbed (a randomized spectrum on every rank). The same
        on every rank: the guard's state is agreed."""
        return self.guard is not None and self.guard.state == "admitted" and step < lowrank_share.LATER

    def reads_at(self, step: int) -> bool:
        """Whether ``step`` takes a share reading: one is due (a window's
        every EVERY-th step) and the guard, if any, does not skip it."""
        return lowrank_share.LowrankShare.due(step) and not self.skips_reading(step)

    def _reads_during(self, steps: int) -> bool:
        """Whether the guard takes a share reading in this step or the
        ``steps - 1`` after it. A due re-check (also the one asked for by a
        reading that takes lowrank back, at the close of a window that may
        have another inside the re-check's rounds: 80-90, then 100-120)
        waits until its rounds would miss every reading: a reading step took
        15-35 ms more than the others on digits on the 2 x 2 testbed (an
        exact spectrum of a 256 x 256 matrix on every rank; 3-5 ms more since
        the range finder reads it), the rounds take turns step by step, and
        the first re-check, AUTO_SETTLE steps after a first decision near
        step 15, fell in the window 100-120, where one round could take most
        of its readings (bench/README "Digits' best mode on the Intel Xeon").
        The same on every rank: the steps and the guard's state are agreed."""
        return self.guard is not None and any(self.reads_at(t) for t in range(self.s.iter, self.s.iter + steps))

    def read_ranks(self, rank: int) -> Optional[List[int]]:
        """The ranks a guard's reading is taken at, lowrank's ``rank`` last:
        also WAIT_RANK where it is larger (a reading under FIRST_DROP waits
        where that rank carries the gradient: :meth:`Guard.update`)."""
        return [lowrank_guard.WAIT_RANK, rank] if self.guard is not None and rank < lowrank_guard.WAIT_RANK else None

    def _guarded(self, mode: str) -> bool:
        return self.guard is not None and mode == "lowrank"

    def _excluded(self, cand: Tuple) -> bool:
        """A candidate the trials no longer measure (lowrank refused)."""
        return self._guarded(cand[0]) and self.guard.state == "refused"

    def _blocked(self, cand: Tuple) -> bool:
        """A candidate no bucket may run outside a trial (lowrank neither
        admitted nor provisional)."""
        return self._guarded(cand[0]) and not self.guard.runs()

    def lowrank_rank(self) -> Optional[int]:
        """The rank lowrank runs at now where it is not the HookState's
        (auto's provisional one: before its first reading, and while it
        waits after one, :attr:`Guard.rank_now`), else None."""
        return self.guard.rank_now if self.guard is not None and self.guard.provisional else None

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

    def _order_of(self, key: str, prune: bool = False) -> List[int]:
        """The candidates of ``key`` in trial order: the current choice first
        (round 0 of a re-check), then by prediction, the guarded lowrank last
        unless it is predicted fastest and a bucket may run it now (round 0
        is what the first trial measures the others against, and chooses
        without them where they are hopeless: :meth:`_skip_hopeless`);
        ``prune``: without those measured hopeless (:attr:`pruned`)."""
        cands = self.candidates[key]
        first = self.decided.get(key)
        if first is not None and self._excluded(cands[first]):
            first = None
        out = self.pruned.get(key, set()) if prune else set()
        rest = [j for j, c in enumerate(cands) if j != first and c[:2] not in out and not self._excluded(c)]
        lead = next((j for j in rest if self._guarded(cands[j][0])), None)
        if lead is not None and not self._blocked(cands[lead]) and cands[lead][2] is not None and \
                all(cands[j][2] is None or cands[lead][2] < cands[j][2] for j in rest if j != lead):
            rest.remove(lead)
            rest.insert(0, lead)
        return rest if first is None else [first] + rest

    def _orders(self, prune: bool = False, fixed: Optional[Dict[str, int]] = None) -> Dict[str, List[int]]:
        """Every bucket's candidates in trial-round order, the rounds paired by
        name. Round 0: each bucket's own first (:meth:`_order_of`: its plan
        as it runs in a re-check, else its best predicted; ``fixed``: the
        candidates buckets already ran in it). Then one round per (mode,
        algorithm) that some bucket offers: every bucket that offers it runs
        it, the others their own first; a round that repeats another is not
        run twice. Those rounds go by their summed prediction, the guarded
        lowrank's last, unless it leads some bucket's order (its first in a
        first trial, its first or second in a re-check): then its round is
        round 0 of a first trial (on every bucket that offers it) or round 1
        of a re-check.

        Why by name: a step's buckets share the links and their collectives
        go out together, so the step a round measures is its plans' together.
        Paired by each bucket's c-th prediction, the cnn task's buckets on the
        2 x 2 testbed at 100 Mbit were ordered int3 across nodes, fp8 across
        nodes, int3 flat (the large) and int3 flat, int3 across nodes, fp8
        across nodes (the small): no round ran int3 across nodes on both, the
        fixed `int3`'s plan (bench/README "A convolutional task"); the wide
        model's lowrank, first on its large bucket and last on its small one,
        never ran on both, whose all-reduces go out together (36-41 ms a step
        there against 31-33: "lowrank's round on every bucket")."""
        own = {k: o for k, o in ((k, self._order_of(k, prune)) for k in self.candidates) if o}
        fixed = {k: j for k, j in (fixed or {}).items() if k in own}

        def name(k: str, j: int) -> Tuple[str, str]:
            return self.candidates[k][j][:2]

        def runs(k: str, n: Tuple[str, str]) -> int:  # n on bucket k, or k's own first
            return next((j for j in own[k] if name(k, j) == n), own[k][0])

        guarded = next((name(k, j) for k, o in own.items() for j in o if self._guarded(name(k, j)[0])), None)
        lead = 1 if self._rechecking else 0
        leads = guarded is not None and any(guarded in [name(k, j) for j in o[:lead + 1]] for k, o in own.items())
        first = {k: fixed.get(k, runs(k, guarded) if leads and not self._rechecking else o[0]) for k, o in own.items()}

        def rank(n: Tuple[str, str]) -> Tuple[int, float]:
            if n == guarded:
                return (-1 if leads else 1), 0.0
            ts = [self.candidates[k][runs(k, n)][2] for k in own]
            return 0, INF if any(t is None for t in ts) else sum(ts)
        names = sorted(dict.fromkeys(name(k, j) for k, o in own.items() for j in o), key=rank)
        rounds = [first]
        for n in names:
            r = {k: runs(k, n) for k in own}
            if r not in rounds:
                rounds.append(r)
        return {k: [r[k] for r in rounds] if k in own else [] for k in self.candidates}

    def _join(self, key: str) -> None:
        """A bucket planned while a trial runs (DDP hands its buckets over one
        by one in the first step; a resumed bucket whose candidates changed):
        in the trial's first step the rounds are paired again with it, what
        the others ran in round 0 kept; later (their rounds have run) it
        takes its own order."""
        if self.trial_start is not None and self.compressed_steps == self.trial_start:
            self._order = self._orders(fixed={k: o[0] for k, o in self._order.items() if o and k != key})
        else:
            self._order[key] = self._order_of(key)

    def _candidate_in_round(self, key: str, c: int) -> int:
        """The candidate of ``key`` that trial round ``c`` runs (a bucket with
        fewer candidates than rounds runs its first again)."""
        order = self._order[key]
        return order[c] if c < len(order) else order[0]

    def _round_candidates(self, c: int) -> List[Tuple[str, str, Optional[float]]]:
        """What trial round ``c`` runs: each bucket's candidate (buckets with
        candidates to try)."""
        return [self.candidates[k][self._candidate_in_round(k, c)] for k in self._order if self._order[k]]

    def _start_trial(self, full: bool = False) -> None:
        self.trial_start = self.compressed_steps
        self._rechecking = bool(self.decided)
        self._confirming = self._rechecking and self.confirm_at is not None and \
            self.compressed_steps >= self.confirm_at
        self.confirm_at = None  # a trial that starts for another reason measures what it would have
        prune = False
        if self._rechecking:
            self.rechecks += 1
            self.confirms += self._confirming
            prune = not full and (self._confirming or (self.rechecks - self.confirms) % AUTO_FULL_EVERY != 0)
        self._order = self._orders(prune)
        self._step_times, self._times, self._kept, self._skipped = {}, {}, None, None

    def _in_trial(self) -> bool:
        if self.trial_start is None:
            return False
        t, first = self.compressed_steps - self.trial_start, len(self._cycle())
        return t < first or (self._kept is not None and t < first + (AUTO_REPEATS - 1) * len(self._kept))

    def _rounds(self) -> int:
        return max((len(o) for o in self._order.values()), default=0)

    def _cycle(self) -> List[int]:
        """The rounds of the trial's first cycle, in turn."""
        return [c for c in range(self._rounds()) if c not in (self._skipped or ())]

    def _round(self) -> int:
        """This step's trial round: rounds take turns, so a drifting load
        (another job, a warming cache) weighs on every candidate alike."""
        t, cycle = self.compressed_steps - self.trial_start, self._cycle()
        return cycle[t] if t < len(cycle) else self._kept[(t - len(cycle)) % len(self._kept)]

    def _skip_hopeless(self, engine) -> None:
        """The first trial, after its first round (each bucket's best
        predicted candidate): every rank all-gathers that round's step time;
        the rounds whose *predicted* communication alone (the cost model's
        time of each bucket's collective, summed) is over AUTO_SPAN times
        that round's slowest rank are left out of the trial. A step ends
        after its buckets' collectives, whose bytes share the links, so such
        a round cannot be faster than the one measured (the topology probe's
        bandwidth at 100 Mbit is 0.88-1.0x the link's: the AUTO_SPAN margin
        is for a probe that misjudged it).
        fp32 on the wide model at 100 Mbit: one step of 600 ms where fp8's
        takes 165. Re-checks measure what they keep (the first trial's
        skipped rounds are pruned, as hopeless, and measured again by the
        full re-checks)."""
        _, times = self._gather_round_times(engine)
        first = max(r[0] for r in times)

        def predicted(c: int) -> float:
            ts = [cand[2] for cand in self._round_candidates(c)]
            return 0.0 if any(t is None for t in ts) else sum(ts)
        self._skipped = [c for c in range(1, self._rounds()) if first < INF and predicted(c) > AUTO_SPAN * first]

    def _cut(self, engine) -> None:
        """After the trial's first cycle: every rank all-gathers its step
        time of each round; the rounds whose slowest rank took over
        AUTO_SPAN times the fastest round's run no more (their one time
        still counts in the decision, which they cannot win). The fastest
        may be lowrank's while it waits for its reading (a rank given): the decision among
        the others then rests on one step each until the re-check
        AUTO_SETTLE steps later measures them again (on the wide model at
        100 Mbit, where lowrank is admitted, repeating them would cost about
        1.4 s: two more steps each of fp8 and bf16 across nodes and of fp8
        flat, at their measured times)."""
        _, times = self._gather_round_times(engine)
        worst = [max(col) for col in zip(*times)]  # inf: a rank has no time for it
        best = min((w for w in worst if w < INF), default=INF)
        self._kept = [c for c in self._cycle() if worst[c] == INF or best == INF or worst[c] <= AUTO_SPAN * best]

    def _gather_round_times(self, engine, head: Sequence[int] = ()):
        """Every rank all-gathers ``head`` and its best step time of each
        trial round: (the ranks' heads, each rank's seconds per round, inf
        where it has none)."""
        import torch

        row = list(head) + [int(min(self._step_times[c]) * 1e9) if self._step_times.get(c) else -1
                            for c in range(self._rounds())]
        gathered = engine.submit_config(torch.tensor(row, dtype=torch.int64)).wait()
        times = [[t / 1e9 if t >= 0 else INF for t in r[len(head):]] for r in gathered.tolist()]
        return gathered[:, :len(head)], times

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
        if self.trial_start is not None and not self._rechecking and self._skipped is None and \
                self.compressed_steps - self.trial_start == 1 and self._rounds() > 1:
            self._skip_hopeless(engine)
        if self.trial_start is not None and self._kept is None and \
                self.compressed_steps - self.trial_start == len(self._cycle()):
            self._cut(engine)
        if self.trial_start is not None and not self._in_trial():
            self._decide(engine)
            self.trial_start = None
            # a trial in the run's first AUTO_SETTLE compressed steps (the first; one measuring lowrank as it is
            # admitted) is checked again AUTO_SETTLE steps later: early steps are slower and noisier
            self.next_check = self.compressed_steps + (AUTO_SETTLE if self.compressed_steps < AUTO_SETTLE else
                                                       AUTO_RECHECK)
            if any(self._blocked(self.candidates[k][j]) for k, j in self.decided.items()):
                self._first_trial_again()  # lowrank, refused while the trial ran, was all it measured
        elif self.trial_start is None and self.decided and \
                self.compressed_steps >= min(self.next_check, INF if self.confirm_at is None else self.confirm_at) \
                and not self._reads_during(AUTO_REPEATS * max(map(len, self._orders().values()), default=1)):
            self._start_trial()  # re-check: the rounds again, the current plans first; then the hysteresis rule

    def _decide(self, engine) -> None:
        """Every rank all-gathers its step time per trial round (and a
        fingerprint of its candidates); the round whose slowest rank was
        fastest gives every bucket its plan."""
        keys = sorted(self.candidates)
        rounds = self._rounds()
        names = ";".join(f"{k}:" + ",".join(f"{m}/{a}" for m, a, _ in self.candidates[k]) for k in keys)
        fingerprints, times = self._gather_round_times(engine, [zlib.crc32(names.encode())])
        if (fingerprints != fingerprints[0]).any():
            raise ValueError("hetcomm: compression='auto' ranks planned different candidates for the same buckets "
                             "(different topologies or options): construct HookState alike on every rank")
        self.round_times = [max(c) for c in zip(*times)]
        judged = [self._judged(r) for r in times]
        current = 0 if self._rechecking and self._allowed(0) else None
        if current is not None and self._runs_guarded(choose(judged)) and not self._runs_guarded(current):
            # toward the guarded lowrank its margin (0.7) asks more than the hysteresis (0.9), not both: by both it
            # had to take 0.63x the current round, and a wide-model run measuring it at 0.636x kept int3 at 1.6x
            # lowrank's step for the rest of the run (away from lowrank both still apply: a band, no flapping)
            current = None
        best = choose(judged, current)
        changed = 0
        for k in keys:
            j = self._candidate_in_round(k, best)
            changed += self.decided.get(k, j) != j
            self.decided[k] = j
            # what this trial measured hopeless is left out of the next pruned re-check; what it measured
            # within AUTO_SPAN is back in
            # (by its fastest round: a bucket runs its first in the rounds of names it does not offer)
            pruned, fastest = self.pruned.setdefault(k, set()), {}
            for c in range(rounds):
                i = self._candidate_in_round(k, c)
                fastest[i] = min(fastest.get(i, INF), self.round_times[c])
            for i, t in fastest.items():
                cand = self.candidates[k][i][:2]
                if t > AUTO_SPAN * self.round_times[best] and i != j:
                    pruned.add(cand)
                else:
                    pruned.discard(cand)
            per_bucket = self._times.get(k, {})
            self.measured[k] = [min(per_bucket[i]) if per_bucket.get(i) else None
                                for i in range(len(self.candidates[k]))]
        self.confirm_at = self.compressed_steps + AUTO_CONFIRM if self._rechecking and not self._confirming and \
            self._kept_by_margin(best) else None
        waits = not self._allowed(min(range(len(times[0])), key=lambda c: (self.round_times[c], c)))
        log.info("hetcomm: auto plan: trial round %d of %s (step ms, slowest rank)%s; buckets: %s%s", best,
                 ", ".join(f"{1000 * t:.4g}" for t in self.round_times),
                 f" - re-planned {changed} bucket(s)" if self._rechecking and changed else "",
                 "; ".join(f"[{k[:24]}] {self.candidates[k][self.decided[k]][0]}/"
                           f"{self.candidates[k][self.decided[k]][1]}" for k in keys),
                 f" (a faster round with lowrank waits for its reading at step {lowrank_share.next_close(self.s.iter)})"
                 if waits else f" (lowrank's round faster, not by its margin: a re-check confirms it {AUTO_CONFIRM} "
                 "steps on)" if self.confirm_at is not None else "")
        self._times, self._step_times = {}, {}

    # ---- the guard on lowrank ----------------------------------------------------------
    def _allowed(self, c: int) -> bool:
        """Whether trial round ``c`` ran no blocked candidate on any bucket."""
        return not any(self._blocked(cand) for cand in self._round_candidates(c))

    def _runs_guarded(self, c: int) -> bool:
        """Whether trial round ``c`` runs the guarded lowrank on some bucket."""
        return any(self._guarded(cand[0]) for cand in self._round_candidates(c))

    def _margin(self) -> float:
        """The guarded lowrank's margin now: PROVISIONAL_MARGIN while it runs
        provisionally (its guard's reading decides again), else LOWRANK_MARGIN."""
        return PROVISIONAL_MARGIN if self.guard is not None and self.guard.provisional else LOWRANK_MARGIN

    def _judged(self, times: Sequence[float]) -> List[float]:
        """Round times as a decision weighs them: inf where a round runs a
        blocked candidate; a round that runs the guarded lowrank, its time
        over its margin (:meth:`_margin`)."""
        margin = self._margin()
        return [INF if not self._allowed(c) else t / margin if self._runs_guarded(c) else t
                for c, t in enumerate(times)]

    def _kept_by_margin(self, best: int) -> bool:
        """Whether the decision for round ``best`` kept a round without the
        admitted lowrank by its margin alone: a round with it measured faster
        (the slowest rank's time). On the wide model at 100 Mbit (2 x 2
        testbed) the re-check at lowrank's admission read rank 4 at
        0.38-0.64x int3's step on most runs but kept int3 on 1-3 of 12, which
        then ran at 1.5x lowrank's step until the re-check AUTO_SETTLE steps
        later took lowrank. A confirmation helps where that reading was
        noisy, not where it was biased: as glibc's malloc comes, a step that
        switches plans faults its temporaries in afresh, and one AdamW run
        read lowrank at 0.72x four times and kept int3 to its end
        (bench/README "A re-check that keeps int3 by lowrank's margin alone
        is confirmed")."""
        if self.guard is None or self.guard.state != "admitted" or self._runs_guarded(best):
            return False
        return any(self._runs_guarded(c) and self._allowed(c) and t < self.round_times[best]
                   for c, t in enumerate(self.round_times))

    def _read_guard(self, engine) -> None:
        """After a window of share readings: every rank all-gathers its means
        (at WAIT_RANK and lowrank's rank; -1: none, e.g. a non-finite
        gradient); the lowest decide, the same on every rank."""
        step = self.s.iter - 1
        last = self.s._lowrank_share.last
        width = len(self.read_ranks(self.s._rank_ladder.rank) or [None])  # the same on every rank
        own = last.get("ladder", [last["share"]]) if last is not None and last["step"] == step else []
        lowest = lowrank_share.agreed_lowest(engine, step, own if len(own) == width else [None] * width,
                                             "compression='auto'")
        if lowest is None:
            return
        before, timed_at = self.guard.state, self.lowrank_rank()
        if self.guard.update(lowest[-1], step, lowest[0] if width > 1 else None):
            if self.guard.state != "admitted":
                self.confirm_at = None  # what it would confirm is no longer allowed
            if before != "refused":
                self._repick()
                if self.guard.state == "admitted" and timed_at not in (None, self.s._rank_ladder.rank) and \
                        self._lost_provisionally():
                    self.next_check = self.compressed_steps  # a re-check, once its rounds miss every reading
            elif self.trial_start is not None:
                self._start_trial()  # taken back while a trial runs without it: the trial again, with it
            else:  # taken back: the trials since its refusal left it out; a re-check measures it, as soon as its
                self.next_check = self.compressed_steps  # rounds miss every reading (begin_step, _reads_during)

    def _lost_provisionally(self) -> bool:
        """Whether no bucket runs lowrank after its admission though the last
        trial timed it, provisionally (at rank 16, or 8 while it waited),
        where it runs at the ladder's rank now (4): on the 2 x 2 testbed at
        100 Mbit the wide model's large bucket then ran int3 at 68-80 ms a
        step until the re-check AUTO_SETTLE steps later measured lowrank at
        44-49, on 8 runs of 20; the re-check comes at once instead."""
        return self.trial_start is None and \
            not any(self._guarded(self.candidates[k][j][0]) for k, j in self.decided.items()) and \
            any(t < INF and self._runs_guarded(c) for c, t in enumerate(self.round_times))

    def _repick(self) -> None:
        """The guard admitted or refused lowrank: every bucket takes the
        fastest round of the last trial that it now allows (the slowest
        rank's times, the same everywhere). Without such a round (the trial
        measured lowrank alone, the others hopeless against it; a resumed
        run saved before any) the first trial starts again, without lowrank."""
        if self.trial_start is not None:
            return  # the running trial decides on the new state
        times = self._judged(self.round_times) if self._order else []
        if any(t < INF for t in times):
            best = choose([times])
            for k in self._order:
                self.decided[k] = self._candidate_in_round(k, best)
            return
        if self.decided:
            self._first_trial_again()

    def _first_trial_again(self) -> None:
        """The first trial, again, without what is blocked now: the guard
        refused lowrank, and the last trial measured no round without it."""
        self.decided = {}
        self._start_trial()

    # ---- what is saved ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The choices, and what a resumed run needs to go on as this one
        would: each bucket's candidates, the last trial's round order and
        times (lowrank admitted later takes the fastest round they allow),
        a running trial's progress and step times, the guard."""
        out = {"decided": {k: list(self.candidates[k][j][:2]) for k, j in self.decided.items()},
               "compressed_steps": self.compressed_steps, "next_check": self.next_check,
               "rechecks": self.rechecks, "confirm_at": self.confirm_at, "confirms": self.confirms,
               "pruned": {k: sorted(map(list, v)) for k, v in self.pruned.items() if v},
               "candidates": {k: [list(c) for c in v] for k, v in self.candidates.items()},
               "order": {k: list(v) for k, v in self._order.items()}, "round_times": list(self.round_times)}
        if self.trial_start is not None:
            out["trial"] = {"start": self.trial_start, "rechecking": self._rechecking, "confirming": self._confirming,
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

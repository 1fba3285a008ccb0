"""``compression="auto"``'s guarded lowrank (a part of :class:`hetcomm.autoplan.AutoPlanner`).

lowrank, offered by default where the gradient alone is compressed, is a
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
included (where the plans that run have no lowrank and its round wins
not, they stay), and where none takes lowrank, a re-check measures it
at once at the rank it now runs at (the trials timed it at 16), against
the plans that run alone, as a confirmation does (a re-check of lowrank
leaves the schedule's where it was). A round with the guarded lowrank wins only at
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
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from . import autotrial, lowrank_guard, lowrank_share
from .autotrial import INF

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


class GuardedLowrank:
    """The guard on lowrank's part of :class:`hetcomm.autoplan.AutoPlanner`
    (whose ``__init__`` holds the state these methods read: ``guard``,
    ``candidates``, ``decided``, the last trial's ``round_times``)."""

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
                    self.lowrank_asks = True  # a re-check of lowrank, once its rounds miss every reading
            elif self.trial_start is not None:
                self._start_trial()  # taken back while a trial runs without it: the trial again, with it
            else:  # taken back: the trials since its refusal left it out; a re-check measures it, as soon as its
                self.lowrank_asks = True  # rounds miss every reading (begin_step, _reads_during)

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
        rank's times, the same everywhere), lowrank's by its margin; where the
        plans that run have no lowrank and lowrank's round does not win, they
        stay. Without such a round (the trial
        measured lowrank alone, the others hopeless against it; a resumed
        run saved before any) the first trial starts again, without lowrank."""
        if self.trial_start is not None:
            return  # the running trial decides on the new state
        times = self._judged(self.round_times) if self._order else []
        if any(t < INF for t in times):
            best = autotrial.choose([times])
            running = [self.candidates[k][j] for k, j in self.decided.items()]
            if running and not self._runs_guarded(best) and not any(self._guarded(c[0]) for c in running):
                # the plans that run have no lowrank, and lowrank's round wins not by its margin: the decision
                # that chose them stands (it weighed the other rounds by the hysteresis and every cycle). By the
                # fastest round alone the admission at step 30 took int3 flat from int3 across nodes on 3 digits runs
                # of 16 with each optimizer (2 x 2 testbed, 100 Mbit; bench/README "A re-check for lowrank measures
                # lowrank")
                return
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

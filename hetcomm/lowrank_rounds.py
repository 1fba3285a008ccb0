"""lowrank's rounds a step: pipelined or together, chosen by measuring both.

Each lowrank bucket needs two all-reduces (P with the dense parts, then Q^T),
and every round waits for the slowest rank and the link's latency. Pipelined
(the engine's default), a bucket's first all-reduce goes out as soon as DDP
hands it over, behind the rest of backward, and its second goes with the next
bucket's first: B buckets cost B + 1 rounds. Together, every bucket but the
step's last computes its P and waits; the last sends the step's first
all-reduces in one, then their second ones in one: two rounds, and nothing
behind backward. Which is faster depends on how much backward is left when
the first bucket comes: on the wide model at 100 Mbit (DDP's default buckets:
two, where fc1's backward after the first is about 1 ms) together took
31-32 ms a step against 36-38 pipelined (bench/README "lowrank's rounds
together"); on a model whose buckets come far apart, pipelining hides rounds.

So a lowrank run (and an auto run that offers lowrank: there the steps
where its buckets ran another compressed plan are not counted, nor a step
whose plans were not the step's before: it pays for the switch; in either a
step that read lowrank's share is not counted: it pays for the reading) measures
both in turns, steps 11-30 after its first
compressed step (``start_iter``, 1 by default), in turns A B B A (steps 11
and 14 pipelined, 12 and 13 together, ...): a machine's speed drifts, and
measured one window after the other, or odd steps against even ones, two
identical schedules differed by 13-15 % on the 2 x 2 testbed. Each rank takes
the median of each one's step times (the time between the steps' first
buckets, so an evaluation between two steps counts once at most), and at
step 31 the ranks all-gather them; the slowest rank's medians decide, the
same on every rank: together, unless pipelined's is under PIPELINED_MARGIN
times together's (a window of twenty noisy steps read a difference of a few
per cent either way where together was 4-10 % faster). Under auto, whose guard admits lowrank at step 30 or
later, a window where some rank ran no step of an arm decides pipelined for
now, and the first step after one whose every compressed bucket ran lowrank
opens another (at most AGAIN more). The choice changes the order in which the sums' terms
are added, not what is computed (on 2 ranks not a bit). ``state_dict()``
keeps it and the times so far: a run resumed after step 31 runs the same
schedule; one saved inside the trial decides from the saved times and those
it measures after the resume (not its first step: the plans before it
are not saved), so on more than 2 ranks its sums may round differently from
the uninterrupted run's if the two decide differently.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional

from .lowrank_share import agreed_lowest

TRIAL = (11, 31)  #: steps [a, b) after start_iter - 1, in turns; decided when step b opens
ARMS = ("pipelined", "together")  # in turns A B B A from TRIAL[0]
WINDOW = TRIAL[1] - TRIAL[0]  #: a window's steps (a reopened one's too)
AGAIN = 3  #: windows more, at most, where one measured nothing (auto ran no lowrank there) and lowrank runs later
#: pipelined is chosen only where its median is under this share of together's: with the choice fixed for whole
#: runs together took 0.90-0.91x pipelined's step on the wide model with SGD-m and 0.94-0.96x with AdamW (2 x 2
#: testbed, 100 Mbit, SCHED_BATCH), and was the faster on every model measured here so far, but a window of steps
#: 2-4 ms apart, each ranging 16-68 ms, chose pipelined by 1-11 % of the medians on 7 of 32 runs (bench/README
#: "lowrank's rounds, fixed for a run; a re-check's steps after a switch")
PIPELINED_MARGIN = 0.95


class RoundsTrial:
    """Whether lowrank's buckets wait for the step's last one (``hold``)."""

    def __init__(self, on: bool, start_iter: int = 1) -> None:
        self.on = on  # a mode whose lowrank buckets measure their rounds (else pipelined, not saved)
        self.start = start_iter - 1 + TRIAL[0]  # the window's first step
        self.again = 0  # windows opened after the first (reopen)
        self.choice: Optional[str] = None if on else "pipelined"
        self.times: Dict[str, List[float]] = {arm: [] for arm in ARMS}
        self.medians: Optional[Dict[str, float]] = None  # the ranks' slowest, when decided
        self._opened: Optional[tuple] = None  # (step, monotonic time) of the last step's first bucket

    @property
    def pending(self) -> bool:
        return self.choice is None

    def hold(self, step: int) -> bool:
        """Whether the buckets of ``step`` (all but its last) wait for the last."""
        if self.choice is not None:
            return self.choice == "together"
        return self._arm(step) == "together"

    def _arm(self, step: int) -> Optional[str]:
        if not self.start <= step < self.start + WINDOW:
            return None
        return ARMS[(step - self.start) % 4 in (1, 2)]

    def open_step(self, step: int, engine, counts: bool = True) -> None:
        """At each step's first bucket: the last step's time goes to its arm
        (``counts``: it ran lowrank, and no other compressed plan, with the
        plans of the step before it, and read no share: under auto, a step of
        its trial's other rounds or of another plan does not, nor the lowrank
        step after one; a reading step does not either); when the step after
        them opens the ranks decide."""
        if self.choice is not None:
            return
        now = time.monotonic()
        arm = self._arm(step - 1)
        if arm is not None and counts and self._opened is not None and self._opened[0] == step - 1:
            self.times[arm].append(now - self._opened[1])
        self._opened = (step, now)
        if step >= self.start + WINDOW:
            self._decide(engine, step)

    def _decide(self, engine, step: int) -> None:
        own = [statistics.median(self.times[arm]) if self.times[arm] else None for arm in ARMS]
        slowest = agreed_lowest(engine, step, own, "lowrank's", highest=True, what="choosing its rounds")
        if slowest is None:  # some rank has no step of one measured (auto ran no lowrank): the engine's default
            self.choice = "pipelined"
            return
        self.medians = dict(zip(ARMS, slowest))
        faster = self.medians["pipelined"] < PIPELINED_MARGIN * self.medians["together"]
        self.choice = "pipelined" if faster else "together"

    @property
    def unmeasured(self) -> bool:
        """Decided pipelined because some rank had no step of an arm (auto
        ran other plans through the window), with windows left to open."""
        return self.on and self.choice == "pipelined" and self.medians is None and self.again < AGAIN

    def reopen(self, step: int) -> None:
        """A window from ``step`` (its turns as the first's), where the last
        measured nothing and every compressed bucket of the step before ran
        lowrank: auto admits lowrank at step 30 or later, after the first
        window, and on the wide model at 100 Mbit its buckets then ran
        pipelined at 35-37 ms a step where together took 30-32 (2 x 2
        testbed; bench/README "lowrank's round on every bucket"). The
        caller decides from the agreed plans, so every rank opens it at the
        same step (a run resumed there may open it a step later: its first
        step has no plans before it; the choice is a measurement either way)."""
        self.start, self.again, self.choice, self._opened = step, self.again + 1, None, None
        self.times = {arm: [] for arm in ARMS}

    def settle(self) -> None:
        """Nothing to measure (auto without lowrank among its modes): pipelined,
        and no window to open later (the hook then looks at no step's plans)."""
        if self.choice is None:
            self.choice = "pipelined"
        self.again = AGAIN

    def describe(self) -> dict:
        return {"state": "measuring" if self.choice is None else "chosen", "rounds": self.choice,
                "median_s": self.medians}

    def state_dict(self) -> dict:
        return {"choice": self.choice, "times": {k: list(v) for k, v in self.times.items()},
                "medians": self.medians, "start": self.start, "again": self.again}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """A state saved before the trial existed ran pipelined: it stays so."""
        if sd is None:
            self.choice, self.again = "pipelined", AGAIN
            return
        self.choice = sd["choice"]
        self.times = {arm: [float(t) for t in sd["times"].get(arm, [])] for arm in ARMS}
        self.medians = sd.get("medians")
        self.start = int(sd.get("start", self.start))
        self.again = int(sd.get("again", 0))
        self._opened = None

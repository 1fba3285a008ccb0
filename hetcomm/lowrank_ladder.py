"""``compression="lowrank"`` with ``matrix_approximation_rank`` left at its
default: the rank chosen by the ranks' agreed reading of how much of their
gradient each rung carries (:class:`RankLadder`; the readings:
:mod:`hetcomm.lowrank_share`)."""

import logging
from typing import Optional

from .lowrank_share import window_of

log = logging.getLogger("hetcomm")


DEFAULT_RANK = 4  # lowrank's first rung, and auto's lowrank candidate's rank (PowerSGD's hook: 1)
RUNGS = (1, 2, 4)  # a lowrank left at its default chooses among DEFAULT_RANK times these
# ... the smallest whose share of every rank's gradient energy is at least this. Stricter than auto's ADMIT, which
# chooses between lowrank and fp8: here a larger rank costs only bytes. 4 ranks, steps 20-30: at 0.975 digits with
# SGD-m took rank 4 (0.979-0.984) and reached 8 of 10 seeds, at 0.99 mostly 8 and 10 of 10; the regression took 8
# (0.978-0.989) and reached 2 of 3 AdamW seeds, at 0.99 16 and 3 of 3 (bench/README "lowrank chooses its rank")
RUNG_BAR = 0.99


class RankLadder:
    """``compression="lowrank"`` with ``matrix_approximation_rank`` left at
    its default: the rank, chosen by measurement, the same on every rank.

    Until the first window's reading (steps 20-30, :class:`LowrankShare`)
    lowrank runs at the ladder's top rank (16): rank 4 on the language model
    falls behind from its first steps (bench/README "lowrank's rank on the
    language model": perplexity 7.75 at step 20 against fp32's 6.78, and 30
    steps of it at the start ended 3 % over fp32's in one of four runs). The
    window reads each rank's share of gradient energy at 4, 8 and 16 at once
    (one spectrum); the ranks all-gather them, and the lowest per rung
    decides: the smallest rung at :data:`RUNG_BAR` or more, else the top.
    Without a reading on some rank (every step of the window overflowed)
    the next window decides. Chosen, the rank stays: each matrix's Q keeps its first columns
    (its warm start); a rank under THRESHOLD warns once, as a fixed one does.
    A rank given (``matrix_approximation_rank=N``) is fixed, as in PowerSGD's
    hook."""

    def __init__(self, given: Optional[int]) -> None:
        self.ranks = [given] if given is not None else [DEFAULT_RANK * f for f in RUNGS]
        self.state = "fixed" if given is not None else "pending"  # pending, chosen, fixed
        self.rank = self.ranks[-1]
        self.shares: Optional[list] = None  # the ranks' lowest share per rung, when chosen
        self.step: Optional[int] = None     # ... and the last step of its window

    @property
    def pending(self) -> bool:
        return self.state == "pending"

    def choose(self, shares: list, step: int) -> int:
        """The agreed readings (the ranks' lowest per rung): the rank, from now on."""
        self.rank = next((r for r, s in zip(self.ranks, shares) if s >= RUNG_BAR), self.ranks[-1])
        self.state, self.shares, self.step = "chosen", list(shares), step
        log.info("hetcomm: lowrank takes rank %d: the ranks' lowest share of gradient energy in the top %s singular "
                 "values, steps %d-%d, is %s (a rank is taken at %.3f or more; else the largest)", self.rank,
                 "/".join(map(str, self.ranks)), window_of(step), step, " / ".join(f"{s:.3f}" for s in shares),
                 RUNG_BAR)
        return self.rank

    def describe(self) -> dict:
        return {"state": self.state, "rank": self.rank, "ranks": list(self.ranks), "shares": self.shares,
                "step": self.step}

    def state_dict(self) -> dict:
        return self.describe()

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """A saved choice (agreed by the ranks: any rank's file holds it);
        a state saved under another ladder (a rank given now, or not then)
        leaves this one as constructed. None: a state saved before lowrank
        chose its rank, when its default was a fixed DEFAULT_RANK: it goes on
        at that rank."""
        if sd is None and self.pending:
            self.state, self.rank = "chosen", DEFAULT_RANK
            return
        if not sd or [int(r) for r in sd.get("ranks", [])] != self.ranks:
            return
        self.state, self.rank = str(sd["state"]), int(sd["rank"])
        self.shares = None if sd.get("shares") is None else [float(s) for s in sd["shares"]]
        self.step = None if sd.get("step") is None else int(sd["step"])

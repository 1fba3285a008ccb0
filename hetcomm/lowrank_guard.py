"""``compression="auto"``'s guard on its lowrank candidate (:class:`Guard`):
whether lowrank may run, and at which rank, by the ranks' agreed readings of
how much of their gradient its rank carries (:mod:`hetcomm.lowrank_share`
takes the readings, in windows of steps 20-30, 50-60, 80-90, 100-120, ...).
Its bars (:data:`ADMIT`, :data:`DROP`, :data:`FIRST_DROP`, :data:`WAIT`) are
read at call time, so a test may set them on this module."""

import logging
from typing import Optional

from . import lowrank_share

log = logging.getLogger("hetcomm")


PROVISIONAL_RANK = 16  # auto's lowrank before its first reading (the rank ladder's top: lowrank_ladder's 4 x RUNGS[-1])
ADMIT = 0.975  # auto keeps lowrank past the first window when the ranks' lowest reading is at least this ...
DROP = 0.93    # ... and takes an admitted one back when a later window's reads under this
FIRST_DROP = 0.90  # a first reading under this refuses lowrank; from this up to ADMIT the next window decides (at
#                    ADMIT, or refused). Between the language model (0.77-0.85 at rank 4 in steps 20-30) and the
#                    wide model inside a 30-step learning-rate warm-up (0.928-0.982), not fitted
WAIT_RANK, WAIT = 8, 0.965  # ... unless the top WAIT_RANK singular values carry at least WAIT: then it waits too. In
#                    steps 20-30 on 4 ranks (the ranks' lowest) the language model read 0.908-0.955 at rank 8, the
#                    wide model inside a 300-step warm-up 0.977-0.992 (and 0.836-0.915 at rank 4; from steps 80-120
#                    on 0.975 and more). Halfway, not fitted (bench/README "A refused lowrank reads again")


class Guard:
    """``compression="auto"``'s condition on its lowrank candidate.

    lowrank at rank 4 is the fastest plan where the link binds (the wide model
    at 100 Mbit: half fp8's step) and misses fp32's quality where the gradient
    is not of low rank (the language model). Auto's trial measures lowrank's
    speed from the run's first steps; until the first window's reading
    (steps 20-30: the lowest of the ranks' means, at rank 4) lowrank runs only
    at ``provisional_rank`` (:data:`PROVISIONAL_RANK`, 16: where
    ``matrix_approximation_rank`` is left to hetcomm), the rank at which
    :class:`hetcomm.lowrank_ladder.RankLadder` starts every task, measured to reach fp32's quality
    from its first steps (bench/README "lowrank chooses its rank"; rank 4 at
    the language model's start, then dense, ended 3 % over fp32's perplexity
    in one of four runs). With a rank given, no bucket runs it before the
    reading. The reading admits rank 4 at :data:`ADMIT` and refuses it under
    :data:`FIRST_DROP`, unless the top :data:`WAIT_RANK` (8) singular values
    carry :data:`WAIT` or more (read from the same spectrum): then, as from
    FIRST_DROP up to ADMIT, it waits. The next windows decide
    (steps 50-60, 80-90: admitted at ADMIT, refused under FIRST_DROP where
    rank 8 carries under WAIT; steps 100-120, :func:`~hetcomm.lowrank_share.deadline`: admitted at
    ADMIT, else refused): a window's
    mean moves by 0.01 with one step's share (an fp16 overflow skipped in
    steps 20-40, the first window then, took the wide model's reading from
    0.983 to 0.972; at 100-120 it read 0.999), and a first window inside a
    learning-rate warm-up reads low (the wide model, 30 warm-up steps: rank
    4 at 0.928-0.982 in steps 20-30 over 24 seeds, 0.989-0.998 at 100-120;
    at a constant rate 0.969-0.995 in steps 20-30; bench/README "A
    learning-rate warm-up"). Until then lowrank goes on at
    ``provisional_rank``, as it ran before the reading, or at WAIT_RANK
    where the reading found the top 8 singular values carrying ADMIT or
    more, what admits rank 4 (:attr:`rank_now`; the wide model inside a
    300-step warm-up: 0.977-0.992 in steps 20-30): in the first
    windows recorded rank 16 carried 0.99 and more wherever rank 4 carried
    0.77 or more (bench/README "A first reading between the bars"), and it
    reached the language model's perplexity from the start, where rank 4
    reads 0.77-0.85. On the wide model at 100 Mbit fp8 instead until step 120
    took a seed 3.3x PowerSGD's time to fp32's accuracy; a first reading
    of 0.928, under DROP, which refused lowrank for the rest of the run then,
    took another seed, inside a warm-up, 115 ms a step against 30. Not lower:
    rank 16 until step 120 and fp8 from there took the language model 4.4 %
    over fp32's perplexity on one run of four (SGD-m; refused at step 30, 0.3
    % under it); the language model's rank 8 carries 0.908-0.955 in steps
    20-30 (4 ranks, the ranks' lowest), under WAIT, so it is refused there
    still.
    An admitted lowrank is refused when a later window reads under
    DROP. Refused, lowrank leaves the candidates, and buckets that ran it
    take the best plan the last trial measured without it; its error feedback
    is carried into that plan, nothing dropped. A refused guard reads on, at
    every window, and a reading at ADMIT takes lowrank back (at its rank, not
    provisionally; auto measures it again in a re-check): a long learning-rate
    warm-up reads low at first (the wide model on 4 ranks, 300 warm-up
    steps: 0.836-0.915 in steps 20-30, under FIRST_DROP on 12 runs of 16,
    which waited since WAIT and were refused before it; 0.956-0.99 at steps
    80-90, 0.987 and more from 100-120 on), while where rank 4 misses the
    readings stay under the bar up to step 820 (the language model:
    0.66-0.86; the 4-rank regression with AdamW: 0.86-0.96; bench/README "A
    refused lowrank reads again")."""

    def __init__(self, provisional_rank: Optional[int] = None) -> None:
        self.provisional_rank = provisional_rank
        self.state = "pending"  # pending (measured in trials; run only provisionally), admitted, refused
        self.share: Optional[float] = None  # the last agreed reading (pending with one: it was between the bars)
        self.step: Optional[int] = None     # ... and the last step of its window
        self.changed_at: Optional[list] = None  # [step, share] of the reading that set the state
        self.first: Optional[list] = None  # [step, share] of the first agreed reading
        self.readmitted = 0  # times a reading at ADMIT took a refused lowrank back
        self.share8: Optional[float] = None  # the last agreed reading at WAIT_RANK (where read)

    @property
    def waits_at(self) -> Optional[int]:
        """WAIT_RANK while it waits (pending after a reading) where that
        reading found the top WAIT_RANK singular values carrying ADMIT or
        more and lowrank runs provisionally at a larger rank; else None."""
        waits = self.state == "pending" and self.share8 is not None and self.share8 >= ADMIT
        return WAIT_RANK if waits and self.provisional_rank is not None and WAIT_RANK < self.provisional_rank else None

    @property
    def rank_now(self) -> Optional[int]:
        """The rank a provisional lowrank runs at: :attr:`provisional_rank`,
        or WAIT_RANK while it waits after a reading at which the top WAIT_RANK
        singular values carried ADMIT or more (the bar rank 4 is admitted at)."""
        return self.waits_at or self.provisional_rank

    @property
    def provisional(self) -> bool:
        """Whether lowrank may run at :attr:`provisional_rank` now: pending
        (before any reading was agreed, or after a first one between the
        bars)."""
        return self.provisional_rank is not None and self.state == "pending"

    def runs(self) -> bool:
        """Whether a bucket may run lowrank outside a trial now."""
        return self.state == "admitted" or self.provisional

    def update(self, share: float, step: int, share8: Optional[float] = None) -> bool:
        """An agreed reading (``share8``: at WAIT_RANK, where it was read);
        True when it admits or refuses lowrank now."""
        self.share, self.step, self.share8 = share, step, share8
        if self.first is None:
            self.first = [step, share]
        before = self.state
        if self.state == "pending":
            if share >= ADMIT:
                self.state = "admitted"
            elif (share < FIRST_DROP and (share8 is None or share8 < WAIT)) or step >= lowrank_share.deadline():
                self.state = "refused"
            else:
                log.info("hetcomm: auto's lowrank waits for its next reading%s: the ranks' lowest share of gradient "
                         "energy in its rank, steps %d-%d, is %.3f%s (admitted at %.3f or more, refused under %.2f "
                         "where rank %d carries under %.3f; the reading of steps %d-%d refuses it under %.3f)",
                         "" if self.provisional_rank is None else f" (at rank {self.rank_now} until then)",
                         lowrank_share.window_of(step), step, share,
                         "" if share8 is None else f", at rank {WAIT_RANK} {share8:.3f}",
                         ADMIT, FIRST_DROP, WAIT_RANK, WAIT, lowrank_share.LATER, lowrank_share.deadline(), ADMIT)
        elif self.state == "admitted" and share < DROP:
            self.state = "refused"
        elif self.state == "refused" and share >= ADMIT:
            self.state = "admitted"
            self.readmitted += 1
        if self.state != before:
            self.changed_at = [step, share]
            log.info("hetcomm: auto %s lowrank: the ranks' lowest share of gradient energy in its rank, steps "
                     "%d-%d, is %.3f (admitted at %.3f or more, refused later under %.2f)",
                     "drops" if self.state == "refused" else "keeps" if before == "pending" else "takes back",
                     lowrank_share.window_of(step), step, share, ADMIT, DROP)
        return self.state != before

    def state_dict(self) -> dict:
        return {"state": self.state, "share": self.share, "step": self.step, "changed_at": self.changed_at,
                "first": self.first, "readmitted": self.readmitted, "share8": self.share8,
                "waits_at": self.waits_at}  # (derived: shown in stats, not loaded)

    def load_state_dict(self, sd: dict) -> None:
        self.state = str(sd.get("state", "pending"))
        self.share, self.step, self.changed_at = sd.get("share"), sd.get("step"), sd.get("changed_at")
        self.first = sd.get("first")
        self.readmitted = int(sd.get("readmitted", 0))
        self.share8 = sd.get("share8")

"""How much of a rank's gradient lowrank's rank can carry, measured now and
then: the share of each matrix's energy (squared Frobenius norm) in its top
``rank`` singular values, summed over a step's lowrank matrices.

Error feedback makes the residual nearly all of what lowrank approximates
(bench/README "Could auto tell where lowrank is safe?"), so only the fresh
gradient's spectrum says whether the rank is enough. A reading is the mean of
a *window* of steps: every EVERY-th step of steps FIRST .. FIRST + FIRST_SPAN
(20-30), of as long windows every EARLY steps after it that close before LATER
(50-60, 80-90), then of LATER .. LATER + SPAN, 2 LATER .. 2 LATER + SPAN,
4 LATER ... (one step's share moves by up to 0.04 on a model where lowrank is
safe). In `hetcomm bench train`'s runs (2 ranks, fp8's path, SGD-momentum and AdamW, 4 seeds,
bench/README "The first reading at step 30") the first window (steps 20-30)
read at rank 4 0.983-0.996 on the MLPs where lowrank reaches fp32's quality
(wide, digits), and 0.991-0.996 on the language model at rank 16, which
reaches; 0.77-0.85 on the language model at rank 4 and 0.92-0.96 at rank 8,
which miss; 0.91-0.96 on the regression at rank 4, which reaches on 2 ranks
and misses on 4 with AdamW. Later windows: the MLPs 0.99-1.00, the language model at rank 16
0.97-0.98, at rank 8 0.84-0.91. ``compression="auto"`` offers lowrank on that
reading (:class:`Guard`); a fixed lowrank below :data:`THRESHOLD`
has the ``hetcomm`` logger warn once, naming the fix. At most BUDGET elements
are read a step (a large model's first matrices in DDP's order);
``HookState.stats()["lowrank_share"]`` holds the last window's reading."""

import logging
from typing import Optional, Tuple

import torch

log = logging.getLogger("hetcomm")

FIRST = 20   # the first window's first step (before 20 the shares of runs that miss and reach overlap: bench/README
#              "Could the first reading come earlier?")
FIRST_SPAN = 10  # the first window's steps after its first (20-30 separates as 20-40 did: bench/README "The first
#                  reading at step 30")
EARLY = 30   # more windows of FIRST_SPAN steps every EARLY steps after FIRST, up to LATER (50-60, 80-90): a guard
#              between its bars may admit lowrank there, as soon as a learning-rate warm-up is over (an admitted
#              guard leaves them unread: AutoPlanner.skips_reading)
SPAN = 20    # a later window's steps after its first
EVERY = 5    # a reading every EVERY steps inside a window
LATER = 100  # later windows start at LATER, 2 LATER, 4 LATER, ...
THRESHOLD = 0.92
EXACT_UP_TO = 256  # matrices with at most this many rows or columns: exact singular values; larger: estimated
OVERSAMPLE, POWER_STEPS = 10, 2
BUDGET = 1 << 22  # elements read a step (and one matrix at least): a large model's first ones in DDP's order


def top_shares(g: torch.Tensor, ranks, gen: torch.Generator) -> Tuple[list, float]:
    """([energy in the top r singular values for r in ``ranks``], total
    energy) of the matrix ``g``; above EXACT_UP_TO in both dimensions a
    randomized range finder (Halko et al.) for the largest r, with a private
    generator, so the caller's random stream is untouched. Its estimates are
    from below."""
    top = max(ranks)
    if min(g.shape) <= EXACT_UP_TO:
        s2 = _svdvals(g.double()).pow(2)  # their sum is the energy
        return [float(s2[:r].sum()) for r in ranks], float(s2.sum())
    # the squares summed in float64 without a float64 copy of g (the copy and the transposed product below took
    # over half of a reading's 15 ms on a 1024 x 1104 matrix, one thread)
    total = float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
    g = g.float()  # float32 products: a share, not a bit-exact quantity
    k = min(top + OVERSAMPLE, min(g.shape))
    omega = torch.randn(g.shape[1], k, generator=gen).to(g.device)
    y = g @ omega
    for _ in range(POWER_STEPS):
        y = torch.linalg.qr(y)[0]
        y = g @ (y.t() @ g).t()  # g^T y as (y^T g)^T: BLAS writes a k x cols block 2x faster than a cols x k one
    basis = torch.linalg.qr(y)[0]
    s2 = _svdvals((basis.t() @ g).double()).pow(2)
    return [float(s2[:r].sum()) for r in ranks], total


def _svdvals(a: torch.Tensor) -> torch.Tensor:
    """Singular values; on a GPU by cuSOLVER's QR-based gesvd: torch's default
    there, the Jacobi gesvdj, failed to converge on a reading of digits'
    gradient on an H200 (2026-11-30) and warned while torch fell back to gesvd."""
    return torch.linalg.svdvals(a, driver="gesvd") if a.is_cuda else torch.linalg.svdvals(a)


def top_share(g: torch.Tensor, rank: int, gen: torch.Generator) -> Tuple[float, float]:
    """(energy in the top ``rank`` singular values, total energy) of ``g``
    (:func:`top_shares` at one rank)."""
    nums, total = top_shares(g, [rank], gen)
    return nums[0], total


def compressed_at(rows: int, cols: int, rank: int) -> bool:
    """Whether lowrank approximates a rows x cols matrix at ``rank`` (P and Q
    less than half its size, PowerSGD's rule; else it is sent dense)."""
    r = min(rank, rows, cols)
    return rows * cols > 2 * (rows + cols) * r


def span_of(start: int) -> int:
    """The steps of the window that begins at ``start`` after its first."""
    return FIRST_SPAN if start < LATER else SPAN


def _early_starts() -> range:
    """The first steps of the windows before LATER: FIRST, then every EARLY
    steps those that close before LATER."""
    return range(FIRST, max(FIRST, LATER - FIRST_SPAN - 1) + 1, EARLY)


def window_of(step: int) -> Optional[int]:
    """The first step of the window ``step`` lies in, or None."""
    if step < LATER:
        return next((s for s in _early_starts() if s <= step <= s + FIRST_SPAN), None)
    start = LATER << ((step // LATER).bit_length() - 1)  # the largest LATER * 2^k <= step
    return start if step <= start + SPAN else None


def next_close(step: int) -> int:
    """The last step of the first window that closes at ``step`` or later."""
    start = next((s for s in _early_starts() if step <= s + FIRST_SPAN), None)
    if start is not None:
        return start + FIRST_SPAN
    start = LATER
    while start + SPAN < step:
        start *= 2
    return start + SPAN


def deadline() -> int:
    """The last step of the window at LATER: where a guard still between its
    bars decides (:meth:`Guard.update`)."""
    return LATER + SPAN


class LowrankShare:
    """Windows of readings over a step's lowrank (or, under auto's guard,
    lowrank-sized) buckets."""

    def __init__(self) -> None:
        # {"step", "share", "rank", "readings"}: the last closed window's; read at several ranks (a lowrank whose
        # rank is not yet chosen: RankLadder; auto's guard: at WAIT_RANK and its rank), also "ladder": the share at
        # each of them, "share" at the last
        self.last: Optional[dict] = None
        self.warned = False
        self._nums: list = []  # this step's energy in the top r singular values, per rank read
        self._den = 0.0
        self._read = 0
        self._open = False
        self._window: list = []  # this window's per-step shares (one per rank read) so far
        self._gen = torch.Generator().manual_seed(0)

    def state_dict(self) -> dict:
        """What a resumed run needs to read as this one would: the open
        window's shares, the last reading, the warning, the random stream of
        the range finder."""
        return {"window": list(self._window), "last": None if self.last is None else dict(self.last),
                "warned": self.warned, "generator": self._gen.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self._window = [[float(v) for v in x] if isinstance(x, (list, tuple)) else [float(x)]
                        for x in sd.get("window", [])]
        self.last = None if sd.get("last") is None else dict(sd["last"])
        self.warned = bool(sd.get("warned", False))
        if sd.get("generator") is not None:
            self._gen.set_state(sd["generator"])

    @staticmethod
    def due(step: int) -> bool:
        start = window_of(step)
        return start is not None and (step - start) % EVERY == 0

    @staticmethod
    def closes(step: int) -> bool:
        """Whether ``step`` is the last step of a window (every rank knows it)."""
        start = window_of(step)
        return start is not None and step == start + span_of(start)

    def add(self, buf: torch.Tensor, layout: torch.Tensor, ranks: Optional[list] = None) -> None:
        """The matrices of one lowrank bucket (rows of ``layout`` with a rank)
        in this rank's gradient ``buf``, before it is reduced; at each of
        ``ranks`` (a matrix lowrank would send dense at one carries all of it
        there; the rank in use last: the window's :attr:`last` share), or at
        the layout's own."""
        for off, rows, cols, rank in layout.tolist():
            if rank and (self._read == 0 or self._read + rows * cols <= BUDGET):  # one matrix at least
                self._read += rows * cols
                g = buf.narrow(0, off, rows * cols).view(rows, cols)
                if not bool(torch.isfinite(g).all()):  # an overflow step (GradScaler skips it): no reading
                    self._den = float("nan")
                    return
                at = [rank] if ranks is None else [min(r, rows, cols) for r in ranks]
                nums, den = top_shares(g, at, self._gen)
                nums = [n if ranks is None or compressed_at(rows, cols, r) else den for n, r in zip(nums, at)]
                self._nums = [a + b for a, b in zip(self._nums, nums)] if self._nums else nums
                self._den += den
                self._open = True

    def end_step(self, step: int, rank: int, world_rank: int, warn: bool = True) -> None:
        """After the step's buckets: its share joins the window; a window's
        last step closes it (its mean is :attr:`last`). ``warn``: a fixed
        lowrank warns below THRESHOLD (auto's guard decides instead)."""
        nums, den, read = self._nums, self._den, self._open
        self._nums, self._den = [], 0.0
        self._read = 0
        self._open = False
        if read and den > 0:  # something read, and the gradient finite
            self._window.append([n / den for n in nums])
        if not self.closes(step):
            return
        shares, self._window = self._window, []
        if not shares or len({len(s) for s in shares}) != 1:  # (a resumed window read at other ranks: none)
            return
        means = [sum(col) / len(shares) for col in zip(*shares)]
        share = means[-1]  # at the rank in use (a ladder's reading: at its largest, run until it chooses)
        self.last = {"step": step, "share": share, "rank": rank, "readings": len(shares)}
        if len(means) > 1:
            self.last["ladder"] = means
        if warn and len(means) == 1 and share < THRESHOLD and not self.warned and world_rank == 0:
            self.warn(rank, share, step)

    def warn(self, rank: int, share: float, step: int) -> None:
        """Once a run: lowrank's rank carries under THRESHOLD of the gradient."""
        self.warned = True
        log.warning(
            "hetcomm: lowrank at matrix_approximation_rank=%d carries %.0f %% of this rank's gradient energy in "
            "steps %d-%d (its top %d singular values, over the compressed matrices). In hetcomm bench train it "
            "read 96-100 %% where lowrank reached fp32's quality, 63-96 %% where it missed, 86-95 %% on a "
            "regression that reached on 2 ranks and missed on 4: this run may fall short of fp32's quality. "
            "Raise matrix_approximation_rank (the language model there needs 16 where 4 misses) or use "
            "compression='fp8' or 'auto'", rank, 100 * share, window_of(step), step, rank)


def agreed_lowest(engine, step: int, own: list, who: str, highest: bool = False,
                  what: str = "reading lowrank's share") -> Optional[list]:
    """The ranks' lowest (``highest``: highest) of each of ``own`` (this
    rank's non-negative measurements, e.g. window means, or None where it has
    none, e.g. every step of the window overflowed), all-gathered after the
    steps that closed at ``step``; None where some rank has none. ``who`` and
    ``what`` name the caller in the error for ranks at different steps."""
    row = [step] + [-1 if v is None else int(v * 1e9) for v in own]
    gathered = engine.submit_config(torch.tensor(row, dtype=torch.int64)).wait()
    if (gathered[:, 0] != step).any():
        raise ValueError(f"hetcomm: {who} ranks are at different steps ({gathered[:, 0].tolist()}) when {what}: "
                         "every rank must run the same steps")
    if (gathered[:, 1:] < 0).any():
        return None
    values = gathered[:, 1:].max(dim=0).values if highest else gathered[:, 1:].min(dim=0).values
    return (values.double() / 1e9).tolist()


PROVISIONAL_RANK = 16  # auto's lowrank before its first reading (RankLadder's top: 4 x RUNGS[-1])
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
    :class:`RankLadder` starts every task, measured to reach fp32's quality
    from its first steps (bench/README "lowrank chooses its rank"; rank 4 at
    the language model's start, then dense, ended 3 % over fp32's perplexity
    in one of four runs). With a rank given, no bucket runs it before the
    reading. The reading admits rank 4 at :data:`ADMIT` and refuses it under
    :data:`FIRST_DROP`, unless the top :data:`WAIT_RANK` (8) singular values
    carry :data:`WAIT` or more (read from the same spectrum): then, as from
    FIRST_DROP up to ADMIT, it waits. The next windows decide
    (steps 50-60, 80-90: admitted at ADMIT, refused under FIRST_DROP where
    rank 8 carries under WAIT; steps 100-120, :func:`deadline`: admitted at
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
            elif (share < FIRST_DROP and (share8 is None or share8 < WAIT)) or step >= deadline():
                self.state = "refused"
            else:
                log.info("hetcomm: auto's lowrank waits for its next reading%s: the ranks' lowest share of gradient "
                         "energy in its rank, steps %d-%d, is %.3f%s (admitted at %.3f or more, refused under %.2f "
                         "where rank %d carries under %.3f; the reading of steps %d-%d refuses it under %.3f)",
                         "" if self.provisional_rank is None else f" (at rank {self.rank_now} until then)",
                         window_of(step), step, share, "" if share8 is None else f", at rank {WAIT_RANK} {share8:.3f}",
                         ADMIT, FIRST_DROP, WAIT_RANK, WAIT, LATER, deadline(), ADMIT)
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
                     window_of(step), step, share, ADMIT, DROP)
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

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
reading (:class:`hetcomm.lowrank_guard.Guard`); a fixed lowrank below :data:`THRESHOLD`
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
EXACT_UP_TO = 256  # matrices with at most this many rows or columns: shares within EXACT_TOL; larger: estimated
EXACT_TOL = 1e-6  # ... by the range finder at 2 x the largest rank + OVERSAMPLE columns where the energy it leaves out
#                   is at most this (what it leaves out bounds its error: see top_shares), else singular values
OVERSAMPLE, POWER_STEPS = 10, 2
BUDGET = 1 << 22  # elements read a step (and one matrix at least): a large model's first ones in DDP's order


def top_shares(g: torch.Tensor, ranks, gen: torch.Generator) -> Tuple[list, float]:
    """([energy in the top r singular values for r in ``ranks``], total
    energy) of the matrix ``g``, with a private generator, so the caller's
    random stream is untouched.

    A randomized range finder (Halko et al.) for the largest r, stopping at
    its first basis where that holds the whole matrix (a gradient of a batch
    smaller than its columns: its values are then exact). Above EXACT_UP_TO
    in both dimensions, at r + OVERSAMPLE columns and POWER_STEPS power
    steps, its estimates are from below. Up to it, within EXACT_TOL of the
    total energy of the exact ones: at 2 r + OVERSAMPLE columns, a
    projection's singular values are each at most the matrix's, so each
    top-r sum misses at most the energy its basis leaves out, the total less
    the projection's, which it checks; over EXACT_TOL of the total, one pass
    at twice the columns (no power steps: since 2026-12-04), and over it
    still (or where 4 x those columns exceed the smaller side), the exact
    singular values (:func:`_energies`).

    A step's gradient of a batch of b samples has rank b at most: digits'
    256 x 256 weight (32 samples a rank) held all but 4e-7 of its energy or
    less in its top 26 singular values at every reading of a run, the range
    finder fell back on 2 readings of 28 (SGD-m), and it took 0.6 ms of one
    thread against 5.3 for the exact values; a reading step on the 2 x 2
    testbed took 30-52 ms against 15-25 for the others, then 20-23 against
    16-18 (bench/README "A reading of a small matrix by the range finder").
    auto's guard reads at ranks 8 and 4 (26 columns): a random 256 x 1024
    matrix of rank 32 fell back on the exact values (18-21 ms of one
    thread), the pass at 52 columns holds it (5.9 ms); the readings of the
    cnn task's weight in steps 20-120 took 1.7 ms against 3.4 before the
    first basis was checked, digits' 0.9 against 1.8 (bench/README "The
    guard's reading of a batch's gradient")."""
    top = max(ranks)
    small = min(g.shape) <= EXACT_UP_TO
    k = min(2 * top + OVERSAMPLE if small else top + OVERSAMPLE, min(g.shape))
    if small and 4 * k > min(g.shape):  # the exact singular values cost about as little
        return _exact(g, ranks)
    # the squares summed in float64 without a float64 copy of g (the copy and the transposed product below took
    # over half of a reading's 15 ms on a 1024 x 1104 matrix, one thread)
    total = float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
    gf = g.float()  # float32 products: a share, not a bit-exact quantity
    b = _projection(gf, _range(gf, k, gen))
    if small:
        # no power steps up to EXACT_UP_TO: a basis of k columns bounds the error only where it holds all but
        # EXACT_TOL, which a matrix with more than that past its top k singular values misses after them too, and
        # twice the columns hold a batch's gradient in one pass at their cost (digits' weight: 0.51 ms a reading
        # against 0.53 with them; an LSTM's full-rank matrices went through them to the exact values, 3.9 against
        # 5.1 ms; bench/README "The guard's readings from the Gram matrix")
        if _left_out(b, total) > EXACT_TOL * total:
            # a batch's gradient of rank over k (32 samples, the guard's 26 columns) fits in twice as many columns
            wide = 2 * k
            b = _projection(gf, _range(gf, wide, gen)) if 4 * wide <= min(g.shape) else None
            if b is None or _left_out(b, total) > EXACT_TOL * total:
                return _exact(g, ranks)
    # over EXACT_UP_TO the power steps, unless the first basis holds the whole matrix (a gradient of a batch under k:
    # the power steps would not move its values)
    elif _left_out(b, total) > EXACT_TOL * total:
        for _ in range(POWER_STEPS):
            b = _projection(gf, torch.linalg.qr(gf @ b.t())[0])
    s2 = _energies(b.double())
    return [float(s2[:r].sum()) for r in ranks], total


def _range(gf: torch.Tensor, width: int, gen: torch.Generator) -> torch.Tensor:
    """An orthonormal basis of ``gf``'s range sampled at ``width`` random
    columns (drawn from ``gen`` on the CPU: the same on any device)."""
    omega = torch.randn(gf.shape[1], width, generator=gen, dtype=torch.float32, device="cpu").to(gf.device)
    return torch.linalg.qr(gf @ omega)[0]


def _projection(gf: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``basis^T gf`` (g^T basis as its transpose: BLAS writes a k x cols
    block 2x faster than a cols x k one)."""
    return basis.t() @ gf


def _left_out(b: torch.Tensor, total: float) -> float:
    """The energy of a matrix of energy ``total`` that its projection ``b``
    on an orthonormal basis leaves out."""
    return total - float(torch.linalg.vector_norm(b, dtype=torch.float64)) ** 2


def _exact(g: torch.Tensor, ranks) -> Tuple[list, float]:
    """:func:`top_shares` from the exact squared singular values."""
    s2 = _energies(g.double())  # their sum is the energy
    return [float(s2[:r].sum()) for r in ranks], float(s2.sum())


def _energies(a: torch.Tensor) -> torch.Tensor:
    """The squared singular values of ``a`` (float64), largest first: the
    eigenvalues of its Gram matrix over its smaller side. Their error is
    that of float64 arithmetic on the largest, some 1e-14 of the energy
    against EXACT_TOL's 1e-6; LAPACK's singular values took 5x as long (the
    guard's reading of digits' 256 x 256 weight: 0.9 of its 1.2-1.4 ms, one
    thread; bench/README "The guard's readings from the Gram matrix"), and
    cuSOLVER's default Jacobi SVD failed to converge on a reading of digits'
    gradient on an H200 (2026-11-30)."""
    gram = a @ a.t() if a.shape[0] <= a.shape[1] else a.t() @ a
    return torch.linalg.eigvalsh(gram).flip(0).clamp_min(0.0)


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
    bars decides (:meth:`hetcomm.lowrank_guard.Guard.update`)."""
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
        self.read_at = -1  # the last step that read (lowrank's rounds do not count it: it paid for the reading)
        self._added = False
        self._nums: list = []  # this step's energy in the top r singular values, per rank read
        self._den = 0.0
        self._read = 0
        self._open = False
        self._window: list = []  # this window's per-step shares (one per rank read) so far
        self._copies: list = []  # this step's matrices to read at its end: (copy, ranks, read at several)
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
        the layout's own. Only copied here (the exchange then reduces ``buf``
        in place); read at :meth:`end_step`, after the step's last bucket was
        submitted, so the reading runs while the buckets are exchanged, not
        before their exchange starts (on the LSTM of ``hetcomm bench train`` a
        reading step of auto's guard took 3.8 ms more than its neighbours with
        a core per rank read before the submit, 2.6 read after it; four ranks
        on two cores 8.8 and 7.5: bench/README "The guard's reading during the
        exchange")."""
        self._added = True
        for off, rows, cols, rank in layout.tolist():
            if rank and (self._read == 0 or self._read + rows * cols <= BUDGET):  # one matrix at least
                self._read += rows * cols
                g = buf.narrow(0, off, rows * cols).view(rows, cols)
                # read on the CPU: the language model's reading (11 matrices of 28-384 x 96) took 110-120 ms a
                # step on an H200 (the steps of the guard's windows against the others: cuSOLVER's gesvd and a
                # sync per matrix), 7 ms of one CPU thread; the copy is what BUDGET bounds, and the reading the
                # same as a CPU bucket's (bench/README "Time to accuracy with CUDA buckets on the 2 x 2 testbed")
                g = g.cpu() if g.device.type != "cpu" else g.clone()
                at = [rank] if ranks is None else [min(r, rows, cols) for r in ranks]
                self._copies.append((g, at, ranks is not None))

    def _read_copies(self) -> None:
        """The readings of the matrices :meth:`add` copied this step, in order."""
        copies, self._copies = self._copies, []
        for g, at, ladder in copies:
            if not bool(torch.isfinite(g).all()):  # an overflow step (GradScaler skips it): no reading
                self._den = float("nan")
                return
            rows, cols = g.shape
            nums, den = top_shares(g, at, self._gen)
            nums = [n if not ladder or compressed_at(rows, cols, r) else den for n, r in zip(nums, at)]
            self._nums = [a + b for a, b in zip(self._nums, nums)] if self._nums else nums
            self._den += den
            self._open = True

    def end_step(self, step: int, rank: int, world_rank: int, warn: bool = True) -> None:
        """After the step's buckets: its share joins the window; a window's
        last step closes it (its mean is :attr:`last`). ``warn``: a fixed
        lowrank warns below THRESHOLD (auto's guard decides instead)."""
        self._read_copies()
        nums, den, read = self._nums, self._den, self._open
        if self._added:
            self.read_at = step
        self._nums, self._den, self._added = [], 0.0, False
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

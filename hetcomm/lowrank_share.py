"""How much of a rank's gradient lowrank's rank can carry, measured now and
then: the share of each matrix's energy (squared Frobenius norm) in its top
``rank`` singular values, summed over a step's lowrank matrices.

Error feedback makes the residual nearly all of what lowrank approximates
(bench/README "Could auto tell where lowrank is safe?"), so only the fresh
gradient's spectrum says whether the rank is enough. In `hetcomm bench
train`'s runs (2 ranks, SGD-momentum, DDP's buckets) it read, at steps
100 / 200 / 400: the MLPs at rank 4 (wide, digits) 0.99-1.00 and the language
model at rank 16 0.97-0.98, all reaching fp32's quality; the language model at
rank 4 0.77 / 0.71 / 0.63 and at rank 8 0.88 / 0.88 / 0.93, both missing; the
regression at rank 4 0.92 / 0.94 / 0.86, which reaches on 2 ranks and misses
on 4 with AdamW. Below :data:`THRESHOLD` the ``hetcomm`` logger warns once,
naming the fix. Measured at steps FIRST, 2 FIRST, 4 FIRST, ... on at most
BUDGET elements a step (a large model's first matrices in DDP's order);
``HookState.stats()["lowrank_share"]`` holds the last reading."""

import logging
from typing import Optional, Tuple

import torch

log = logging.getLogger("hetcomm")

FIRST = 100  # the first step measured (the shares of runs that miss and of runs that reach overlap before it)
THRESHOLD = 0.92
EXACT_UP_TO = 256  # matrices with at most this many rows or columns: exact singular values; larger: estimated
OVERSAMPLE, POWER_STEPS = 10, 2
BUDGET = 1 << 22  # elements read a step (and one matrix at least): a large model's first ones in DDP's order


def top_share(g: torch.Tensor, rank: int, gen: torch.Generator) -> Tuple[float, float]:
    """(energy in the top ``rank`` singular values, total energy) of the
    matrix ``g``; above EXACT_UP_TO in both dimensions a randomized range
    finder (Halko et al.) with a private generator, so the caller's random
    stream is untouched. Its estimate is from below."""
    if min(g.shape) <= EXACT_UP_TO:
        s2 = torch.linalg.svdvals(g.double()).pow(2)  # their sum is the energy
        return float(s2[:rank].sum()), float(s2.sum())
    total = float(g.double().pow(2).sum())
    g = g.float()  # float32 products: a share, not a bit-exact quantity
    k = min(rank + OVERSAMPLE, min(g.shape))
    omega = torch.randn(g.shape[1], k, generator=gen).to(g.device)
    y = g @ omega
    for _ in range(POWER_STEPS):
        y = torch.linalg.qr(y)[0]
        y = g @ (g.t() @ y)
    basis = torch.linalg.qr(y)[0]
    s2 = torch.linalg.svdvals((basis.t() @ g).double()).pow(2)
    return float(s2[:rank].sum()), total


class LowrankShare:
    """A step's reading over its lowrank buckets, at the steps due."""

    def __init__(self) -> None:
        self.last: Optional[dict] = None  # {"step", "share", "rank"}
        self.warned = False
        self._num = self._den = 0.0
        self._read = 0
        self._open = False
        self._gen = torch.Generator().manual_seed(0)

    @staticmethod
    def due(step: int) -> bool:
        return step >= FIRST and step % FIRST == 0 and ((step // FIRST) & (step // FIRST - 1)) == 0

    def add(self, buf: torch.Tensor, layout: torch.Tensor) -> None:
        """The matrices of one lowrank bucket (rows of ``layout`` with a rank)
        in this rank's gradient ``buf``, before it is reduced."""
        for off, rows, cols, rank in layout.tolist():
            if rank and (self._read == 0 or self._read + rows * cols <= BUDGET):  # one matrix at least
                self._read += rows * cols
                g = buf.narrow(0, off, rows * cols).view(rows, cols)
                if not bool(torch.isfinite(g).all()):  # an overflow step (GradScaler skips it): no reading
                    self._num = self._den = float("nan")
                    return
                num, den = top_share(g, rank, self._gen)
                self._num += num
                self._den += den
                self._open = True

    def end_step(self, step: int, rank: int, world_rank: int) -> None:
        num, den, read = self._num, self._den, self._open
        self._num = self._den = 0.0
        self._read = 0
        self._open = False
        if not read or not (den > 0):  # nothing read, or a non-finite gradient
            return
        share = num / den
        self.last = {"step": step, "share": share, "rank": rank}
        if share < THRESHOLD and not self.warned and world_rank == 0:
            self.warned = True
            log.warning(
                "hetcomm: lowrank at matrix_approximation_rank=%d carries %.0f %% of this rank's gradient energy at "
                "step %d (its top %d singular values, over the compressed matrices). In hetcomm bench train it read "
                "97-100 %% where lowrank reached fp32's quality, 63-88 %% where it missed, 86-94 %% on a regression "
                "that reached on 2 ranks and missed on 4: this run may fall short of fp32's quality. Raise "
                "matrix_approximation_rank (the language model there needs 16 where 4 misses) or use "
                "compression='fp8' or 'auto'", rank, 100 * share, step, rank)

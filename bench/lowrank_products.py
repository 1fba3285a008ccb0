"""lowrank's two products on the CPU, ours against BLAS's: P = M Q and Q^T =
P^T M for M = x / divisor + residual, ``hetcomm.ops.lowrank_project`` and
``lowrank_back_project`` (one pass over x and the residual a product) against
what lowrank ran before them and runs on a GPU, torch's products with the
residual and then with x over the divisor (MKL on the CPU: two products, each a
pass). Each matrix cold (cycled through more than the last-level cache holds),
on one thread; printed, ms a product (the mean over ITERS) and, beside it, one
pass reading x and the residual (``sum``, the least a product can read).
Run alone on an otherwise idle machine (bench/README "lowrank's products in
one pass over x and the residual"):

    python bench/lowrank_products.py [ITERS]
"""
import sys
import time

import torch

from hetcomm import ops

SHAPES = ((1024, 1024, 4), (1024, 1024, 8), (1024, 1024, 16), (4096, 1024, 4), (256, 64, 4))
#: each matrix pair (x, residual) taken in turn from this many bytes: past the last-level cache of the CPUs we run on
POOL_BYTES = 320 * 2 ** 20
DIVISOR = 4.0


def mean_ms(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print("rows x cols, rank: ms a product, cold, one thread (BLAS: torch's two products with the residual and x)")
    print(f"{'shape':>16} {'read x+R':>9} {'P: BLAS':>9} {'ours':>7} {'ratio':>6} {'Q^T: BLAS':>10} {'ours':>7} "
          f"{'ratio':>6}")
    for rows, cols, r in SHAPES:
        n = max(2, POOL_BYTES // (8 * rows * cols))
        xs = [torch.randn(rows, cols, generator=gen) for _ in range(n)]
        rs = [torch.randn(rows, cols, generator=gen) for _ in range(n)]
        qt, p = torch.randn(r, cols, generator=gen), torch.randn(rows, r, generator=gen)
        turn = [0]

        def pair():
            turn[0] += 1
            return xs[turn[0] % n], rs[turn[0] % n]

        def read():
            x, res = pair()
            x.sum(), res.sum()

        def blas_p():
            x, res = pair()
            torch.mm(res, qt.t()).addmm_(x, qt.t(), beta=1.0, alpha=1 / DIVISOR)

        def ours_p():
            x, res = pair()
            ops.lowrank_project(x, qt, res, DIVISOR)

        def blas_q():
            x, res = pair()
            torch.mm(p.t(), res).addmm_(p.t(), x, beta=1.0, alpha=1 / DIVISOR)

        def ours_q():
            x, res = pair()
            ops.lowrank_back_project(x, p, res, DIVISOR)

        floor = mean_ms(read, iters)
        bp, op, bq, oq = (mean_ms(f, iters) for f in (blas_p, ours_p, blas_q, ours_q))
        print(f"{f'{rows} x {cols}, {r}':>16} {floor:9.3f} {bp:9.3f} {op:7.3f} {op / bp:6.2f} {bq:10.3f} {oq:7.3f} "
              f"{oq / bq:6.2f}")


if __name__ == "__main__":
    main()

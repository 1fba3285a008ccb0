"""What lowrank's own work costs a step on the wide model's big bucket
(bench/README "lowrank without its M buffer"), one process, one thread:

- one call of ``allreduce_lowrank`` (world 1, so no wire; rank 4, bf16
  factors, error feedback) on a 1024 x 1104 bucket, median of 50 calls, with
  the cache warm and with 32 MB written between calls (as a backward does);
- one share reading (``lowrank_share.top_shares`` at ranks 4 / 8 / 16, what
  lowrank and auto's guard take every 5th step of a window) of that matrix.

    python bench/lowrank_codec.py [REPEATS]
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hetcomm import _C, lowrank_share

ROWS, COLS, RANK = 1024, 1104, 4


def median_ms(fn, before=None, reps=50, warm=10) -> float:
    times = []
    for i in range(warm + reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    n = ROWS * COLS
    layout = torch.tensor([[0, ROWS, COLS, RANK]])
    q, res = torch.randn(COLS * RANK), torch.zeros(n)
    gen = torch.Generator().manual_seed(0)
    x, fresh, junk = torch.empty(n), torch.randn(n, generator=gen), torch.randn(8 << 20, generator=gen)
    g = torch.randn(ROWS, COLS, generator=gen) @ torch.randn(COLS, COLS, generator=gen) / COLS ** 0.5

    def call():
        t.allreduce_lowrank(x, 4.0, layout, q, res, wire="bf16")

    def refill():
        x.copy_(fresh)

    def refill_and_evict():
        junk.mul_(1.0)
        x.copy_(fresh)

    for k in range(repeats):
        warm = median_ms(call, refill)
        evicted = median_ms(call, refill_and_evict)
        reading = median_ms(lambda: lowrank_share.top_shares(g, [4, 8, 16], gen), reps=15, warm=2)
        print(f"round {k}: allreduce_lowrank {warm:.2f} ms (cache warm), {evicted:.2f} ms (evicted); "
              f"a share reading {reading:.2f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

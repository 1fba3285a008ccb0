"""The language model's gradient-norm bursts on fp32's trajectory, and how
well clipping's count sketch (hetcomm/clip.py) estimates the norm there
(bench/README "The language model on a third CPU").

One process plays the 4 ranks of ``hetcomm bench train --tasks lm --optims
sgd --scale 4 --clip-grad-norm 2`` (each rank's batch of the seed, their
mean gradient, SGD-momentum at the task's rate, clipped at 2 by the exact
norm). Every step it takes the reduced gradient's exact norm and the
sketch's estimate of it under DRAWS sign draws, each fixed for the run as
the hook's are (seeded per bucket); it prints the quantiles of estimate /
exact over all steps and over the steps clipping binds, and the steps of the
largest norms after step 400 against their median.

    python bench/norm_bursts.py [SEED [STEPS [DRAWS]]]
"""
import statistics
import sys

import torch

from hetcomm import clip
from hetcomm.benchmarks import tasks, train

RANKS, MAX_NORM, AFTER = 4, 2.0, 400


def sketch_norm(flat: torch.Tensor, signs: torch.Tensor) -> float:
    """The sketch's estimate of ``flat``'s norm (the sums NormSketch.add makes)."""
    return float(clip.fold(flat * signs).double().pow(2).sum()) ** 0.5


def quantile(values: list, f: float) -> float:
    return values[min(len(values) - 1, int(f * len(values)))] if values else float("nan")


def main(seed: int, steps: int, draws: int) -> None:
    torch.set_num_threads(1)
    task = tasks.TASKS["lm"]()
    task.seed = seed
    model = task.model()
    opt = train.make_optimizer("sgd", model.parameters(), train.task_lr(task, "sgd"))
    params = list(model.parameters())  # clipped in this order, as the bench clips ddp.parameters()
    n = sum(p.numel() for p in params)
    signs = [(torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(1000 + d), dtype=torch.int8) * 2 - 1)
             .float() for d in range(draws)]
    rows = []  # (step, exact norm, [estimate / exact per draw])
    for step in range(steps):
        opt.zero_grad()
        for r in range(RANKS):
            x, y = task.batch_for(step, r)
            (task.loss(model(x), y) / RANKS).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params[::-1]])  # DDP's order, about: the last layers' first
        exact = float(flat.double().pow(2).sum()) ** 0.5
        rows.append((step, exact, [sketch_norm(flat, s) / exact for s in signs]))
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
    print(f"lm, seed {seed}, {steps} steps, {RANKS} ranks' mean gradient, SGD-m, clipped at {MAX_NORM}: "
          f"final perplexity {task.evaluate(model)['perplexity']:.4f}")
    for d in range(draws):
        every = sorted(r[2][d] for r in rows)
        bound = sorted(r[2][d] for r in rows if r[1] > MAX_NORM)
        print(f"sign draw {d}: estimate / exact over all steps min {every[0]:.3f}, 1 % {quantile(every, .01):.3f}, "
              f"median {quantile(every, .5):.3f}, 99 % {quantile(every, .99):.3f}, max {every[-1]:.3f}; over the "
              f"{len(bound)} steps clipping binds min {quantile(bound, 0):.3f}, max {quantile(bound, 1):.3f}")
    late = [(r[1], r[0]) for r in rows if r[0] >= AFTER]
    if late:
        med = statistics.median(v for v, _ in late)
        print(f"after step {AFTER}: clipping binds on {sum(1 for v, _ in late if v > MAX_NORM)} steps; median norm "
              f"{med:.3f}; the largest (step, norm / median):",
              [(s, round(v / med, 1)) for v, s in sorted(late, reverse=True)[:8]])


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 3, int(a[1]) if len(a) > 1 else 1600, int(a[2]) if len(a) > 2 else 4)

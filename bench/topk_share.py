"""Could top-k choose its share by a reading, as lowrank chooses its rank
(bench/README "Could top-k choose its share by a reading?")? The share of
each rank's gradient energy (and of the optimizer's momentum, what `+m`
compresses) in its largest 1 / 3 / 10 % of entries, whole model, in steps
20, 25, 30 (lowrank's first window) of an fp32 run at fp32's rate: two
ranks' batches simulated in one process (the mean of their gradients
steps the optimizer; the lowest of the two ranks' shares is read).

    python bench/topk_share.py classify,regress,lm,wide
"""
import sys

import torch

from hetcomm.benchmarks.tasks import TASKS
from hetcomm.benchmarks.train import task_lr

RATIOS = (0.01, 0.03, 0.10)
READ_AT = (20, 25, 30)
RANKS = 2


def share(v: torch.Tensor, ratio: float) -> float:
    """Energy in the largest ``ratio`` of ``v``'s entries over its energy."""
    e = v.double().pow(2)
    return float(e.topk(max(1, int(ratio * e.numel()))).values.sum() / e.sum())


def run(name: str, optim: str, seed: int):
    task = TASKS[name]()
    task.seed = seed
    torch.manual_seed(seed)
    model = task.model()
    params = list(model.parameters())
    lr = task_lr(task, optim)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9) if optim == "sgd" else torch.optim.AdamW(params, lr=lr)
    moment = "momentum_buffer" if optim == "sgd" else "exp_avg"
    grads_read, moments_read = [], []
    for step in range(1, READ_AT[-1] + 1):
        per_rank = [torch.autograd.grad(task.loss(model(x), y), params)
                    for x, y in (task.batch_for(step, rank) for rank in range(RANKS))]
        if step in READ_AT:
            flat = [torch.cat([g.reshape(-1) for g in gs]) for gs in per_rank]
            grads_read.append([min(share(g, r) for g in flat) for r in RATIOS])
            m = torch.cat([opt.state[p][moment].reshape(-1) for p in params])
            moments_read.append([share(m, r) for r in RATIOS])
        for p, *gs in zip(params, *per_rank):
            p.grad = sum(gs) / RANKS
        opt.step()
    return ([sum(c) / len(c) for c in zip(*grads_read)], [sum(c) / len(c) for c in zip(*moments_read)])


def main() -> None:
    torch.set_num_threads(1)
    for name in sys.argv[1].split(","):
        for optim in ("sgd", "adamw"):
            for seed in (0, 1):
                g, m = run(name, optim, seed)
                print(f"{name:8s} {optim:5s} seed {seed}: gradient top 1/3/10 % "
                      + " ".join(f"{v:.3f}" for v in g) + "   momentum " + " ".join(f"{v:.3f}" for v in m),
                      flush=True)


if __name__ == "__main__":
    main()
